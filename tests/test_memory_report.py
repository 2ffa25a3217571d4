"""`eo.memory_report`: where each byte of a step lives, for this backend and for TPU
and GPU targets compiled here, without running the step; its table and `to_dict`;
and `DoesNotFit` for a step too big, naming what it holds and only the moves that
would help."""

import dataclasses
import functools
import json
import pickle
import sys
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_offload as eo
import eqx_offload.internal as eoi
from eqx_offload.internal import device_advice, Held, mesh_shardings

from .helpers import (
    batches,
    cross_entropy,
    ProjectedStack,
    table_lm,
    TableLM,
    TanhBlock,
)


def to_host(x):
    return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))


def make_step(policy, optimizer=None, loss=cross_entropy):
    optimizer = optimizer or optax.adam(1e-3)
    model = eo.place(table_lm(jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    return eo.train_step(loss, optimizer, policy), model, opt_state


_RUNS: list[int] = []


def _watched_loss(model, tokens, targets):
    """`cross_entropy`, and a record of each time it runs."""
    jax.debug.callback(lambda: _RUNS.append(1))
    return cross_entropy(model, tokens, targets)


class _Compiled(NamedTuple):
    report: eo.MemoryReport
    model: TableLM  # (the step was not run: nothing donated)
    opt_state: Any


@pytest.fixture(scope="module")
def reports():
    """`reports(preset)`: the report of `Policy.<preset>()`'s train step of
    `table_lm` (4 layers, Adam, `_watched_loss`) on this CPU, with the model and
    state it was given; compiled once in this module."""

    @functools.cache
    def compiled(preset: str) -> _Compiled:
        policy = getattr(eo.Policy, preset)()
        step, model, opt_state = make_step(policy, loss=_watched_loss)
        report = eo.memory_report(step, model, opt_state, *next(batches()))
        return _Compiled(report, model, opt_state)

    return compiled


def test_train_step_report_never_runs_the_step(reports):
    report, model, opt_state = reports("offload_all")
    assert _RUNS == [] and not model.head.is_deleted()
    assert report.compiled == "train_step" and report.estimate
    assert report.device_bytes > 0 and report.host_bytes > 0
    params = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    assert report.params == {"pinned_host": params}
    mu = sum(x.nbytes for x in jax.tree.leaves(opt_state[0].mu))
    assert report.opt_state == {"pinned_host": 2 * mu, "device": 4}
    assert report.host["argument"] == params + 2 * mu  # estimate by memory kind
    assert report.host["alias"] == report.host["argument"]  # donated, updated in place
    residuals = {(r.name, r.memory_kind): r.bytes for r in report.residuals or ()}
    assert residuals[("blocks.input", "pinned_host")] == 4 * 2 * 8 * 16 * 4


def test_reports_differ_the_way_policies_do(reports):
    names = ("none", "remat", "offload_residuals", "offload_all")
    report = {name: reports(name).report for name in names}
    kinds = {n: {r.memory_kind for r in report[n].residuals or ()} for n in report}
    assert "pinned_host" not in kinds["remat"] | kinds["none"]
    assert "pinned_host" in kinds["offload_residuals"]
    unnamed = [r for r in report["none"].residuals or () if "unnamed" in r.name]
    assert unnamed  # without remat every intermediate of every layer is saved
    assert report["offload_all"].params == {
        "pinned_host": report["none"].params["device"]
    }


def test_abstract_arguments_allocate_nothing(reports):
    policy = eo.Policy.offload_all()
    optimizer = optax.adam(1e-3)
    abstract = eo.place(eqx.filter_eval_shape(table_lm, jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, abstract, policy)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    step = eo.train_step(_watched_loss, optimizer, policy)
    report = eo.memory_report(step, abstract, opt_state, tokens, tokens)
    assert report.to_dict() == reports("offload_all").report.to_dict()


def test_filter_offload_and_plain_functions():
    model = table_lm(jax.random.key(0))
    tokens, targets = next(batches())
    fn = eqx.filter_jit(eo.filter_offload(cross_entropy, eo.Policy.offload_residuals()))
    report = eo.memory_report(fn, model, tokens, targets)
    assert report.compiled == "filter_offload"
    assert {(r.name, r.memory_kind) for r in report.residuals or ()} >= {
        ("blocks.input", "pinned_host")
    }
    w = to_host(jnp.ones((8, 8)))
    plain = eo.memory_report(
        lambda x, w: x @ jax.device_put(w, jax.memory.Space.Device),
        jnp.ones((4, 8)),
        w=w,
    )
    assert plain.compiled == "function" and plain.residuals is None
    assert plain.arguments == {
        "argument 0": {"device": 128},
        "argument `w`": {"pinned_host": 256},
    }
    assert plain.host["argument"] == 256


def test_str_and_to_dict(reports):
    report = reports("offload_all").report
    text = str(report)
    for row in (
        "footprint",
        "arguments",
        "temporaries",
        "parameters",
        "optimizer state",
        "blocks.input",
        "estimate",
    ):
        assert row in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["device_bytes"] == report.device_bytes
    assert data["residuals"][0].keys() == {"name", "memory_kind", "bytes"}
    assert eo.MemoryReport.from_dict(data).largest_unnamed == report.largest_unnamed


def test_unnamed_residuals_are_broken_down_by_line(reports):
    # What the head and the loss save (outside the `Stacked`): the report names
    # the lines of code that save it.
    report = reports("remat").report
    assert report.residuals is not None and report.largest_unnamed is not None
    other = sum(r.bytes for r in report.residuals if r.name == "(other)")
    parts = [r for r in report.largest_unnamed if r.group == "(other)"]
    assert 0 < sum(r.bytes for r in parts) <= other
    assert parts == sorted(parts, key=lambda r: -r.bytes)
    line = cross_entropy.__code__.co_firstlineno + 2  # `softmax_cross_entropy...`
    loss = next(r for r in parts if r.where and r.where.startswith("helpers.py"))
    assert loss.where == (
        f"helpers.py:{line} (cross_entropy) > softmax_cross_entropy_with_integer_labels"
    )
    assert loss.dtype == "float32" and loss.shape == (2, 8, 32)  # the logits' shape
    assert "exp" in loss.operations
    text = str(report)
    assert f"      {loss.where}: " in text
    assert "(other) is saved outside every `Stacked`" in text


def test_tpu_target_matches_a_direct_compile():
    def f(x, w):
        return jnp.tanh(x @ jax.device_put(w, jax.memory.Space.Device)).sum()

    x, w = jnp.ones((256, 512)), jnp.ones((512, 1024))
    report = eo.memory_report(
        f,
        x,
        to_host(w),
        target="tpu-v5e",
    )
    mesh = eoi.chip_mesh("tpu-v5e")
    args = (
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P())),
        jax.ShapeDtypeStruct(
            w.shape,
            w.dtype,
            sharding=NamedSharding(mesh, P(), memory_kind="pinned_host"),
        ),
    )
    stats = jax.jit(f).trace(*args).lower().compile().memory_analysis()
    assert stats is not None
    direct = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )
    assert not report.estimate and report.target == "tpu-v5e"
    assert report.device_bytes == direct
    assert report.host["argument"] == stats.host_argument_size_in_bytes == w.nbytes


def _small_step(policy: eo.Policy):
    """A train step quick to compile for any target: an input projection and three
    stacked `TanhBlock`s of width 128, Adam; abstract arguments."""

    def make(key):
        k1, k2 = jax.random.split(key)
        w_in = jax.random.normal(k1, (16, 128))
        blocks = TanhBlock(jax.random.normal(k2, (3, 128, 128)))
        return ProjectedStack(w_in, eo.Stacked(blocks))

    optimizer = optax.adam(1e-3)
    model = eo.place(eqx.filter_eval_shape(make, jax.random.key(0)), policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), optimizer, policy)
    return step, model, opt_state, jax.ShapeDtypeStruct((8, 16), jnp.float32)


@pytest.mark.parametrize("target", ["tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"])
def test_every_tpu_target_compiles_a_train_step(target):
    report = eo.memory_report(*_small_step(eo.Policy.offload_all()), target=target)
    assert report.host_bytes > 0 and report.device_bytes > 0
    # Donated host-resident parameters and state are updated in place on the host.
    assert report.params is not None and report.opt_state is not None
    on_host = report.params["pinned_host"] + report.opt_state["pinned_host"]
    assert report.host["alias"] == report.host["argument"] == on_host
    # Its time, priced with the chip's own entry.
    assert report.time is not None and report.time.seconds > 0
    assert report.time.hardware == eo.Hardware.of(target)


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` fails
    eoi.chip_mesh.cache_clear()
    try:
        with pytest.raises(
            ImportError,
            match=rf"`pip install 'jax\[tpu\]=={jax.__version__}'`.*a clone of "
            r"eqx_offload, its `tpu` extra: `pip install -e '\.\[tpu\]'`",
        ):
            eo.memory_report(lambda x: x * 2, jnp.ones(3), target="tpu-v5e")
    finally:
        eoi.chip_mesh.cache_clear()


def test_unknown_target():
    with pytest.raises(ValueError, match=r"target='gpu'.*'tpu-v5e'"):
        eo.memory_report(lambda x: x, jnp.ones(3), target="gpu")  # pyright: ignore


def test_report_of_a_sharded_model(getkey):
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("x")))
    report = eo.memory_report(lambda x: x * 2, x)
    assert report.arguments == {"argument 0": {"device": x.nbytes}}
    np.testing.assert_equal(report.device["argument"] > 0, True)


def test_a_program_too_big_for_the_chip():
    def f(x):
        return jnp.broadcast_to(x, (5, x.shape[0])) * 2.0  # 20 GiB out of 4 GiB

    x = jax.ShapeDtypeStruct((2**30,), jnp.float32)
    with pytest.raises(
        eo.DoesNotFit, match=r"not fit in the device memory of one tpu-v5e chip"
    ) as info:
        eo.memory_report(f, x, target="tpu-v5e")
    e = info.value
    # The compiler's figures are on the exception: 20 GiB asked, 15.75 available.
    assert e.target == "tpu-v5e" and e.available_bytes == int(15.75 * 2**30)
    assert e.required_bytes is not None and e.required_bytes >= 20 * 2**30
    assert e.arguments == {"argument 0": {"device": 4 * 2**30}}
    assert "argument argument 0: 4.00 GiB / 0 B" in str(e)


def test_a_train_step_too_big_for_the_chip_says_what_it_holds():
    model = eqx.filter_eval_shape(
        lambda: eqx.nn.Linear(2**15, 3 * 2**14, key=jax.random.key(0))
    )  # 6 GiB of weights, 12 of Adam moments, on the device
    policy = eo.Policy.none()
    optimizer = optax.adam(1e-3)
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(lambda m, x: jnp.sum(m(x)), optimizer, policy)
    x = jax.ShapeDtypeStruct((2**15,), jnp.float32)
    with pytest.raises(eo.DoesNotFit) as info:
        eo.memory_report(step, model, opt_state, x, target="tpu-v5e")
    e = info.value
    assert e.params == {"device": 6 * 2**30 + 4 * 3 * 2**14}
    assert e.opt_state is not None and e.opt_state["device"] >= 12 * 2**30
    assert e.residuals is not None and e.available_bytes == int(15.75 * 2**30)
    assert "optimizer state: 12.00 GiB / 0 B" in str(e)
    # Under `Policy.none()` everything is on the device: each move, and the preset
    # that makes them all.
    assert "parameters on the host (6.00 GiB on the device)" in str(e)
    assert "`Policy(opt_state='pinned_host')`" in str(e)
    assert "`Policy.offload_all()`" in str(e) and e.exceeded == ("device",)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_filter_jit_functions_keep_their_donation_and_non_array_outputs():
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    donating = eqx.filter_jit(lambda x, w: w + x.sum(), donate="all")
    report = eo.memory_report(donating, x, w)
    assert report.device["alias"] == w.nbytes
    keeping = eqx.filter_jit(lambda x, w: (w + x.sum(), "a string", eqx.nn.Identity()))
    assert eo.memory_report(keeping, x, w).device["alias"] == 0


def test_cpu_estimate_aliases_only_within_a_memory_kind():
    x = to_host(jnp.ones((64,)))
    # A donated host input whose output is on the device cannot share its buffer.
    f = jax.jit(
        lambda x: jax.device_put(x, jax.memory.Space.Device) * 2, donate_argnums=0
    )
    report = eo.memory_report(f, x)
    assert report.host == {"argument": 256, "output": 0, "temp": 0, "alias": 0}
    assert report.device["output"] == 256 and report.device["alias"] == 0
    assert report.device_bytes >= 256
    g = jax.jit(lambda x: x * 2, donate_argnums=0)
    same = eo.memory_report(g, jnp.ones((64,)))
    assert same.device["alias"] == 256


def test_a_filter_offload_function_is_reported_as_its_gradient():
    model = table_lm(jax.random.key(0))
    batch = next(batches())
    reports = {
        name: eo.memory_report(
            eo.filter_offload(cross_entropy, getattr(eo.Policy, name)()), model, *batch
        )
        for name in ("none", "remat")
    }
    assert all(r.compiled == "filter_offload" for r in reports.values())
    # The gradient's footprint depends on what is saved for it.
    assert reports["none"].device_bytes > reports["remat"].device_bytes
    assert "gradient" in str(reports["remat"])
    vector = eo.filter_offload(lambda m, t, y: jax.vmap(m)(t), eo.Policy.remat())
    with pytest.raises(
        ValueError, match=r"must return a scalar loss or `\(loss, aux\)`"
    ):
        eo.memory_report(vector, model, *batch)

    def with_aux(model, tokens, targets):
        return cross_entropy(model, tokens, targets), {"n": tokens.shape[0]}

    aux = eo.memory_report(
        eo.filter_offload(with_aux, eo.Policy.remat()), model, *batch
    )
    assert aux.compiled == "filter_offload"


def test_capacity_and_static_arguments():
    report = eo.memory_report(lambda x, n: x * n, jnp.ones(3), 2, target="tpu-v5e")
    # What the compiler lets a program use, not the nominal 16 GiB; and the host
    # memory behind one chip, the 48 GB of `eo.Hardware.of("tpu-v5e")`.
    assert report.capacity == int(15.75 * 2**30) and report.fits_device
    assert report.host_capacity == 48 * 10**9 and report.fits_host and report.fits
    lines = str(report).splitlines()
    assert f"{'capacity of one chip':<34}{'15.75 GiB':>14}{'44.70 GiB':>14}" in lines
    assert f"{'  verdict':<34}{'fits':>14}{'fits':>14}" in lines
    assert list(report.arguments) == ["argument 0"]  # the static 2 holds no memory
    cpu = eo.memory_report(lambda x: x, jnp.ones(3))
    assert cpu.capacity is None and cpu.host_capacity is None
    assert cpu.fits is None and cpu.fits_device is None and cpu.fits_host is None
    assert "verdict" not in str(cpu)


def test_single_device_leaves_get_no_sharding_constraint():

    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    one = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(mesh, P()))
    mesh4 = jax.make_mesh(
        (4,),
        ("x",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:4],
    )
    four = jax.device_put(jnp.ones(4), NamedSharding(mesh4, P("x")))
    assert mesh_shardings([one, four, None]) == (None, four.sharding, None)


def test_capacities_are_what_the_compiler_allows():
    # As libtpu 0.0.42 states them ("exceeds available HBM (15.75G)").
    assert eoi.HBM_BYTES == {
        "tpu-v5e": int(15.75 * 2**30),
        "tpu-v6e": int(31.25 * 2**30),
        "tpu-v5p": int(95.74 * 2**30),
        "tpu-v4": int(15.25 * 2**30),
    }


def test_a_saved_prng_key_is_reported_with_its_dtype():
    """A key saved on a line of its own (the input of a rematerialised block):
    its row shows the key's dtype, which is no NumPy dtype."""

    def loss(w, key):
        key = jax.random.fold_in(key, 3)

        @jax.checkpoint
        def block(x, key):
            keep = jax.random.bernoulli(key, 0.5, x.shape)
            return jnp.sin(jnp.where(keep, x, 0.0)) * w

        return block(w * 2, key).sum()

    fn = eo.filter_offload(loss, eo.Policy.none())
    report = eo.memory_report(fn, jnp.ones(3), jax.random.key(0))
    assert report.largest_unnamed is not None
    (saved,) = [r for r in report.largest_unnamed if r.dtype.startswith("key<")]
    assert saved.shape == () and saved.operations == ("random_fold_in",)
    assert saved.where is not None and saved.where.endswith("(loss)")
    assert "key<fry>[]" in str(report)


def _with_host_memory(n: int) -> eo.Hardware:
    return dataclasses.replace(eo.Hardware.of("tpu-v5e"), host_memory_bytes=n)


def test_a_step_over_the_hosts_memory_does_not_fit():
    """Host memory counts: an `offload_all` step whose host footprint exceeds the
    host memory behind one chip (here 64 KiB, as `hardware=` states it) fits the
    device and not the host, so it does not fit; the table says which, and what
    would shrink the host's share, never more offloading."""
    small = _with_host_memory(2**16)
    step = _small_step(eo.Policy.offload_all())
    report = eo.memory_report(*step, target="tpu-v5e", hardware=small)
    assert report.host_bytes > 2**16 and report.host_capacity == 2**16
    assert report.fits_device is True and report.fits_host is False
    assert report.fits is False
    text = str(report)
    lines = text.splitlines()
    assert f"{'capacity of one chip':<34}{'15.75 GiB':>14}{'64.00 KiB':>14}" in lines
    assert f"{'  verdict':<34}{'fits':>14}{'does NOT fit':>14}" in lines
    assert "the host memory is exceeded; to shrink it:" in text
    flat = " ".join(text.split())  # (the advice is wrapped)
    assert "FSDP over a slice" in flat and "'tpu-v5e:2x2'" in flat
    assert "`optax.adamw(..., mu_dtype=jnp.bfloat16)`" in flat
    assert "a smaller model" in flat and "`eo.plan(..., target='tpu-v5e')`" in flat
    assert "offload_all" not in flat and "'pinned_host'" not in flat
    data = json.loads(json.dumps(report.to_dict()))
    assert (data["fits"], data["fits_device"], data["fits_host"]) == (
        False,
        True,
        False,
    )
    assert data["host_capacity"] == 2**16
    assert eo.MemoryReport.from_dict(data).fits_host is False
    # The rule is the report's: the same figures with room on the host fit.
    roomy = eo.MemoryReport.from_dict(data | {"host_capacity": report.host_bytes})
    assert roomy.fits is True and "the host memory is exceeded" not in str(roomy)
    # A report of an older version, without the host's memory: not known.
    old = eo.MemoryReport.from_dict(
        {k: v for k, v in data.items() if k != "host_capacity"}
    )
    assert old.fits_host is None and old.fits is None and old.fits_device is True


def test_a_gpu_step_over_only_the_hosts_memory_is_reported_not_raised():
    """A GPU compile is not refused by its compiler: `memory_report` compares the
    footprints itself, and raises `DoesNotFit` only for the device."""

    def f(x, w):
        return x @ jax.device_put(w, jax.memory.Space.Device)

    w = to_host(jnp.ones((64, 1024)))  # 256 KiB on the host; 64 KiB behind the GPU
    small = dataclasses.replace(eo.Hardware.of("gpu-h100"), host_memory_bytes=2**16)
    report = eo.memory_report(
        f, jnp.ones((4, 64)), w, target="gpu-h100", hardware=small
    )
    assert report.host_bytes == w.nbytes
    assert (report.fits, report.fits_device, report.fits_host) == (False, True, False)


class _Dense(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return x @ self.weight


def _big_batch_step(policy: eo.Policy):
    """Six stacked 1 GiB layers (12 GiB of Adam moments) whose 16 GiB batch alone
    is too big for a v5e chip, whatever the policy; abstract, nothing allocated."""
    n = 2**14
    model = eqx.filter_eval_shape(
        lambda: eo.Stacked.from_fn(
            lambda k: _Dense(jax.random.normal(k, (n, n))), 6, key=jax.random.key(0)
        )
    )
    optimizer = optax.adam(1e-3)
    model = eo.place(model, policy)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(lambda m, x: jnp.sum(m(x) ** 2), optimizer, policy)
    return step, model, opt_state, jax.ShapeDtypeStruct((2**18, n), jnp.float32)


def test_does_not_fit_never_suggests_the_policy_in_use():
    """Under `offload_all` the parameters and optimizer state are on the host
    already: the advice is what would still shrink the device (the batch, more
    chips), not `Policy.offload_all()` nor any move it has made."""
    step, model, opt_state, x = _big_batch_step(eo.Policy.offload_all())
    with pytest.raises(eo.DoesNotFit, match="does not fit in the device memory") as e:
        eo.memory_report(step, model, opt_state, x, target="tpu-v5e")
    text = str(e.value)
    assert e.value.exceeded == ("device",)
    assert "offload_all" not in text and "pinned_host" not in text
    assert "a smaller batch, or micro-batches" in text and "more chips" in text
    # Its host-resident arguments, the weights and moments, within the 48 GB.
    assert e.value.host_available_bytes == 48 * 10**9
    assert e.value.host_required_bytes is not None
    assert 18 * 2**30 <= e.value.host_required_bytes < 18 * 2**30 + 2**20
    assert "its host-resident arguments alone take 18.00 GiB per chip, within" in text
    # Whatever the figures say, the preset in use is never the advice.
    on_device = {"device": 2**30}
    for policy, named in [(eo.Policy.offload_all(), False), (eo.Policy.none(), True)]:
        held = Held({}, params=on_device, opt_state=on_device, residuals=())
        advice = device_advice(
            held, "tpu-v5e", False, "train_step", policy, 2**34, False
        )
        assert ("all of these at once: `Policy.offload_all()`" in advice) == named


def test_does_not_fit_names_both_memories_when_the_host_is_full_too():
    """Optimizer state on the host and a host of 1 GiB a chip: both memories are
    exceeded; the device's advice moves nothing to the host (the parameters stay
    where they are), and the host's is what shrinks it there."""
    step, model, opt_state, x = _big_batch_step(eo.Policy(opt_state="pinned_host"))
    with pytest.raises(eo.DoesNotFit, match="both memories are exceeded") as e:
        eo.memory_report(
            step,
            model,
            opt_state,
            x,
            target="tpu-v5e",
            hardware=_with_host_memory(2**30),
        )
    text = str(e.value)
    assert e.value.exceeded == ("device", "host")
    assert e.value.host_available_bytes == 2**30
    assert e.value.host_required_bytes is not None
    assert e.value.host_required_bytes >= 12 * 2**30  # Adam's two moments
    device, host = text.split("To shrink the host memory:")
    assert "To shrink the device memory:" in device and "pinned_host" not in device
    assert "`Policy.offload_all()`" not in device
    assert "mu_dtype=jnp.bfloat16" in host and "a smaller model" in host


def test_does_not_fit_keeps_the_memories_it_exceeds():
    """`DoesNotFit` pickles whole (`plan` receives it from a child process), with
    the host's figures and the memories it exceeds; `fewest_chips` says of each
    target which memory it exceeded, and advises only on that memory."""
    e = eo.DoesNotFit(
        "too big",
        target="tpu-v5e",
        compiler_message="",
        arguments={},
        sizes=(2**30, 2**34),
        host_sizes=(3 * 2**30, 2**30),
        exceeded=("host",),
    )
    back = pickle.loads(pickle.dumps(e))
    assert back.exceeded == ("host",) and back.required_bytes == 2**30
    assert (back.host_required_bytes, back.host_available_bytes) == (3 * 2**30, 2**30)
    # Over the host only: the host's footprint first.
    why = eoi.planner_fewest_why(back)
    assert (
        why == "does not fit: smallest host footprint 3.00 GiB (over the host budget)"
    )
    both = eo.DoesNotFit(
        "too big",
        target="tpu-v5e",
        compiler_message="",
        arguments={},
        sizes=(2**30, 2**30 - 1),
        host_sizes=(3 * 2**30, 2**30),
        exceeded=("device", "host"),
    )
    assert eoi.planner_fewest_why(both) == (
        "does not fit: smallest device footprint 1.00 GiB (over the host budget, "
        "host footprint 3.00 GiB)"
    )
    none = eoi.none_fits("tpu-v5e", ["tpu-v5e"], {"tpu-v5e": back}, ())
    assert none.exceeded == ("host",) and none.host_required_bytes == 3 * 2**30
    assert "on tpu-v5e it exceeds the host budget" in str(none)
    assert "mu_dtype=jnp.bfloat16" in str(none) and "micro" not in str(none)
