"""`Policy(update_timing="next_forward")` outside the step: `verify`, `save`/`load`,
`state_dict`, `filter_offload`, `memory_report`, `place_opt_state` and
`minimum_traffic` see a state whose update waits (`eo.PendingUpdate`) as the step
does, and never a pending update as if it were applied: a model one update behind
is marked, and refused."""

import dataclasses
import functools
import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo
import eqx_offload.internal as eoi

from .helpers import (
    assert_trees_equal,
    batches,
    cross_entropy,
    memory_kind,
    table_lm,
)
from .minimum_traffic import minimum_traffic


VOCAB, DIM, DEPTH = 32, 8, 3
OPTIMIZER = optax.adam(1e-2)
NEXT_FORWARD = eo.Policy.offload_all(update_timing="next_forward")


# The model every test starts from.
lm = functools.partial(table_lm, jax.random.key(0), VOCAB, DIM, DEPTH)


@functools.cache
def step(policy: eo.Policy, microbatches: int = 1) -> eo.TrainStep:
    """One step object per policy, shared by the tests (each compiles once)."""
    return eo.train_step(cross_entropy, OPTIMIZER, policy, microbatches=microbatches)


def _start(policy: eo.Policy):
    model = eo.place(lm(), policy)
    return model, eo.init_opt_state(OPTIMIZER, model, policy)


def _ready(policy: eo.Policy):
    """A model and state after one step: an update pending."""
    model, opt_state = _start(policy)
    model, opt_state, _, _ = step(policy)(model, opt_state, *next(batches()))
    assert opt_state.ready
    return model, opt_state


# A compute dtype (the cut `PendingUpdate` holds the compute copies) and two
# micro-batches: what `verify` checks, and (the same compiled programs) its
# negative control.
COMPUTE_COPIES = eo.Policy.offload_all(
    update_timing="next_forward", compute_dtype=jnp.bfloat16
)


def _verify_compute_copies() -> eo.VerifyReport:
    model, opt_state = _start(COMPUTE_COPIES)
    tokens, targets = next(batches(batch=4))
    return eo.verify(step(COMPUTE_COPIES, 2), model, opt_state, tokens, targets)


def test_verify_checks_compute_copies_and_micro_batches():
    """`"next_forward"`'s step, its pending update applied, against the whole
    update now (a fresh state: nothing pending), under a compute dtype with two
    micro-batches."""
    report = _verify_compute_copies()
    assert report.update is not None and report.passed


def test_verify_finds_a_pending_update_left_unapplied(monkeypatch):
    """Negative control: without `apply_pending`, the streamed step's stacked
    layers are one update behind the whole one's, and `verify` says so."""

    monkeypatch.setattr("eqx_offload._verify.apply_pending", lambda m, s, o, p: (m, s))
    with pytest.raises(eo.DoesNotMatch, match="after the streamed update"):
        _verify_compute_copies()


def test_verify_exercises_the_update_in_the_forward_scan(monkeypatch):
    """`verify` runs two steps, the second applying the first's held-over update
    in its forward scan. Negative control: that update left out of the forward
    scan (the layers' new parameters dropped) is found."""
    policy = eo.Policy.none(update_timing="next_forward")  # (the cheapest to compile)
    model, opt_state = _start(policy)
    tokens, targets = next(batches(batch=2))
    assert eo.verify(step(policy), model, opt_state, tokens, targets).passed
    owed = eoi.pending_owed

    def stale(layers, trace):
        def keep(update):  # the parameters' slot as it was
            return lambda aux, held: (aux[0], *update(aux, held)[1:])

        layers = {p: x._replace(update=keep(x.update)) for p, x in layers.items()}
        return owed(layers, trace)

    monkeypatch.setattr("eqx_offload._pending.owed", stale)
    with pytest.raises(eo.DoesNotMatch, match="second step"):
        eo.verify(step(policy), model, opt_state, tokens, targets)


def test_verify_save_and_state_dict_refuse_a_pending_update(tmp_path):
    """The state a step returned, or its model (marked) with a fresh state: each
    refused, naming `apply_pending`; nothing is written."""
    model, opt_state = _ready(NEXT_FORWARD)
    assert model.blocks.pending
    fresh = eo.init_opt_state(OPTIMIZER, model, NEXT_FORWARD)
    batch = next(batches())
    for state, what in ((opt_state, "pending update"), (fresh, "'blocks'.*behind")):
        with pytest.raises(ValueError, match=f"`verify`: .*{what}.*apply_pending"):
            eo.verify(step(NEXT_FORWARD), model, state, *batch)
        with pytest.raises(ValueError, match=f"`save`: .*{what}.*apply_pending"):
            eo.save(tmp_path / "ckpt", model, state, step=1)
    with pytest.raises(ValueError, match=r"state_dict`: .*'blocks'.*apply_pending"):
        eo.state_dict(model)
    assert not eo.saved_steps(tmp_path / "ckpt")
    model, opt_state = eo.apply_pending(model, opt_state, OPTIMIZER, NEXT_FORWARD)
    assert not model.blocks.pending
    eo.save(tmp_path / "ckpt", model, opt_state, step=1)
    assert eo.saved_steps(tmp_path / "ckpt") == [1]
    assert eo.state_dict(model)


def _train(policy, model, opt_state, data, n):
    for _ in range(n):
        model, opt_state, _, _ = step(policy)(model, opt_state, *next(data))
    return model, opt_state


def test_resuming_gives_the_numbers_of_not_stopping(tmp_path):
    """2 steps, `apply_pending`, save, load, 2 steps, `apply_pending`: exactly
    what the same steps give without stopping, through the same compiled
    programs. (That those are plain training's, under `"next_forward"`:
    `test_update_timing.py::test_apply_pending`.)"""
    policy = NEXT_FORWARD
    model, opt_state = _start(policy)
    data = batches()
    model, opt_state = _train(policy, model, opt_state, data, 2)
    model, opt_state = eo.apply_pending(model, opt_state, OPTIMIZER, policy)
    eo.save(tmp_path / "ckpt", model, opt_state, step=2)
    abstract = eo.place(eqx.filter_eval_shape(lm), policy)
    like = (abstract, eo.init_opt_state(OPTIMIZER, abstract, policy))
    loaded, state, at = eo.load(tmp_path / "ckpt", like, policy, optimizer=OPTIMIZER)
    # Exactly what was saved, in the places `init_opt_state` puts it.
    assert at == 2 and isinstance(state, eo.PendingUpdate) and not state.ready
    assert_trees_equal((loaded, state), (model, opt_state))
    saved, back = eqx.filter(((model, opt_state), (loaded, state)), eqx.is_array)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(back), strict=True):
        assert memory_kind(a) == memory_kind(b)
    resumed, state = _train(policy, loaded, state, data, 2)
    resumed, _ = eo.apply_pending(resumed, state, OPTIMIZER, policy)

    # Not stopping: the same steps, `apply_pending` after the second included.
    model, opt_state = _start(policy)
    data = batches()
    model, opt_state = _train(policy, model, opt_state, data, 2)
    model, opt_state = eo.apply_pending(model, opt_state, OPTIMIZER, policy)
    unstopped, opt_state = _train(policy, model, opt_state, data, 2)
    unstopped, _ = eo.apply_pending(unstopped, opt_state, OPTIMIZER, policy)
    assert_trees_equal(resumed, unstopped)


def test_load_gives_a_state_with_nothing_pending(tmp_path):
    """A `like` whose state has an update pending (a step's output): the static
    `ready` and the model's mark neither break the comparison with the
    checkpoint nor come back (a checkpoint holds no pending update: the next step
    would apply it)."""
    model, opt_state = _start(NEXT_FORWARD)
    eo.save(tmp_path / "ckpt", model, opt_state, step=0)
    ready_model, ready_state = _ready(NEXT_FORWARD)
    for use in (None, OPTIMIZER):
        loaded, state, _ = eo.load(
            tmp_path / "ckpt", (ready_model, ready_state), NEXT_FORWARD, optimizer=use
        )
        assert isinstance(state, eo.PendingUpdate) and not state.ready
        assert not loaded.blocks.pending
        assert_trees_equal(state, opt_state)


@pytest.mark.parametrize("ready", [False, True])
def test_place_opt_state_moves_a_pending_update(ready):
    """From the device (`Policy.none`) to where `offload_all` puts it, values and
    `ready` kept: parameter-shaped state and waiting gradients on the host."""
    device = eo.Policy.none(update_timing="next_forward")
    model, opt_state = (_ready if ready else _start)(device)
    placed_model = eo.place(model, NEXT_FORWARD)
    placed = eo.place_opt_state(OPTIMIZER, opt_state, placed_model, NEXT_FORWARD)
    assert isinstance(placed, eo.PendingUpdate) and placed.ready == ready
    assert_trees_equal(placed, opt_state)
    fresh = eo.init_opt_state(OPTIMIZER, placed_model, NEXT_FORWARD)
    kinds = [memory_kind(x) for x in jax.tree.leaves(placed)]
    assert kinds == [memory_kind(x) for x in jax.tree.leaves(fresh)]
    assert "pinned_host" in [memory_kind(x) for x in jax.tree.leaves(placed.grads)]


def _transfers(report):
    return sum(t.bytes for t in report.transfers if t.direction == "host_to_device")


def test_memory_report_compiles_the_steady_state(monkeypatch):
    """A fresh state's first step applies nothing; the report is of the steps
    after it (an update pending), for a concrete and for an abstract state."""
    model, opt_state = _start(NEXT_FORWARD)
    batch = next(batches())
    ready = eo.PendingUpdate(opt_state.inner, opt_state.grads, opt_state.held, True)
    steady = eo.memory_report(step(NEXT_FORWARD), model, ready, *batch)
    concrete = eo.memory_report(step(NEXT_FORWARD), model, opt_state, *batch)
    abstract = eo.place(eqx.filter_eval_shape(lm), NEXT_FORWARD)
    state = eo.init_opt_state(OPTIMIZER, abstract, NEXT_FORWARD)
    tokens = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch]
    from_abstract = eo.memory_report(step(NEXT_FORWARD), abstract, state, *tokens)
    for report in (concrete, from_abstract):
        assert _transfers(report) == _transfers(steady)
        assert report.device_bytes == steady.device_bytes
    # The first step's program reads less: the pending update is not there.
    monkeypatch.setattr("eqx_offload._pending.steady", lambda s: s)
    first = eo.memory_report(step(NEXT_FORWARD), model, opt_state, *batch)
    assert _transfers(first) < _transfers(steady)


def test_minimum_traffic_counts_the_gradients_held_on_the_host():
    """Device-resident layers, host-resident state: the waiting gradients go to
    the host and come back (under `update_timing="now"` they stay on the device);
    offloaded layers' gradients move as they do without a held-over update."""
    for preset, moved in (
        (eo.Policy.offload_residuals, True),
        (eo.Policy.offload_all, False),
    ):
        now = preset(opt_state="pinned_host")
        timed = preset(opt_state="pinned_host", update_timing="next_forward")
        model, state_now = _start(now)
        _, state_timed = _start(timed)
        a = minimum_traffic(model, state_now, now, OPTIMIZER)
        b = minimum_traffic(model, state_timed, timed, OPTIMIZER)
        held = sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(state_timed.grads)
        )
        extra = held if moved else 0
        assert b.gradients_to_host == a.gradients_to_host + extra, preset
        assert b.gradients_to_device == a.gradients_to_device + extra, preset
        others = {"gradients_to_host": 0, "gradients_to_device": 0}
        assert dataclasses.replace(b, **others) == dataclasses.replace(a, **others)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu (the `tpu` extra) missing",
)
def test_a_held_over_update_compiles_for_a_tpu():
    """`memory_report` compiles the steady step (an update pending, applied in
    the forward scan) for a TPU. (For a GPU, `test_prefetch.py` compiles it and
    reads its schedule: `test_every_layer_read_overlaps_a_matmul_on_gpu`;
    `benchmarks/compile_matrix.py` compiles more cases.)"""
    model, opt_state = _start(NEXT_FORWARD)
    batch = next(batches())
    report = eo.memory_report(
        step(NEXT_FORWARD), model, opt_state, *batch, target="tpu-v5e"
    )
    assert report.host_bytes > 0
