"""`eo.plan`: the fastest compiled candidate that fits both budgets, `Policy.none()`
when it fits, `DoesNotFit` when nothing does; and the chosen step trains as the
plain one does."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_offload as eo
from eqx_offload._planner import _budget, _plan

from .helpers import batches, cross_entropy, Model


MIB = 2**20
ARGS = (256, 256, 4)  # Model(vocab, dim, depth): parameters and state dominate
TOKENS = jax.ShapeDtypeStruct((2, 16), jnp.int32)
BUDGET = int(24.5 * MIB)


def _abstract():
    return eqx.filter_eval_shape(Model, *ARGS, key=jax.random.key(0))


def _v5e_plan(**budgets) -> eo.Plan:
    """`eo.plan` of the test model's step on a v5e chip."""
    model = _abstract()
    return eo.plan(
        cross_entropy,
        optax.adam(1e-3),
        model,
        TOKENS,
        TOKENS,
        target="tpu-v5e",
        **budgets,
    )


@pytest.fixture(scope="module")
def tight() -> eo.Plan:
    """A device budget `Policy.none()` (33.1 MiB) does not fit on a v5e chip, nor
    the blocks' parameters on the host (29.8 MiB), but Adam's `mu` or `nu` of the
    blocks on the host does (24.1 MiB), faster than all of their state there (20.8
    MiB); a smaller search than the default, to compile less."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_plan, "SINGLES", 3)
        patch.setattr(_plan, "COMBINATIONS", 1)
        return _v5e_plan(device_budget=BUDGET)


def test_a_budget_that_fits_the_plain_step_gets_the_plain_step():
    p = _v5e_plan()
    assert p.policy.save == "all" and p.compiled == 1
    assert [r.status for r in p.table.rows] == ["chosen"]
    assert p.table.device_budget == int(15.75 * 2**30)
    assert p.table.host_budget == eo.Hardware.of("tpu-v5e").host_memory_bytes
    assert p.report.fits and p.report.time is not None


def test_the_fastest_fitting_candidate_is_chosen(tight):
    rows = tight.table.rows
    chosen = [r for r in rows if r.status == "chosen"]
    assert len(chosen) == 1
    assert chosen[0].policy == tight.policy
    assert tight.report.device_bytes <= BUDGET == tight.table.device_budget
    assert tight.report.host_bytes <= tight.table.host_budget
    plain = rows[0]
    assert plain.label.endswith("Policy.none()") and plain.fits is False
    fitting = [r for r in rows if r.fits]
    assert all(r.seconds is not None for r in fitting)
    assert chosen[0].seconds == min(r.seconds for r in fitting if r.seconds is not None)
    preset = next(r for r in rows if r.label.endswith("Policy.offload_all()"))
    assert preset.seconds is not None and chosen[0].seconds is not None
    assert chosen[0].seconds <= preset.seconds
    assert tight.compiled == len(
        [r for r in rows if r.status in ("chosen", "compiled")]
    )
    assert any(r.status.startswith("pruned: frees") for r in rows)  # singles
    # Combinations estimated to fit, not compiled once one fitted.
    assert any(r.status.startswith("pruned: estimated to fit") for r in rows)
    assert all(r.recomputed_flops is None or r.recomputed_flops >= 0 for r in rows)


def test_one_part_of_the_state_moves_when_that_is_enough(tight):
    # Both parts of the blocks' state on the host fit too, but move twice the bytes.
    state = dict(tight.policy.opt_state)
    assert sorted(state.values()) == ["device"] * 5 + ["pinned_host"]
    assert [s for s, kind in state.items() if kind != "device"][0] in (
        "mu:blocks",
        "nu:blocks",
    )
    assert tight.policy.params == tuple(
        (f, "device") for f in ("embed", "blocks", "head")
    )
    both = next(
        r for r in tight.table.rows if r.label.startswith("opt_state on host: blocks;")
    )
    assert both.fits and both.seconds is not None and tight.report.time is not None
    assert tight.report.time.seconds < both.seconds


def test_the_table_prints_and_converts(tight):
    text = str(tight.table)
    assert "chosen" in text and "budgets per device: 24.50 MiB device" in text
    data = json.loads(json.dumps(tight.table.to_dict()))
    assert data["device_budget"] == BUDGET
    assert [r["status"] for r in data["rows"]] == [r.status for r in tight.table.rows]
    assert "compiled in" in str(tight)


def test_the_chosen_step_trains_as_the_plain_step_does(tight):
    """One step of the plan's policy against `Policy.none()` (each step donates
    its model, so each gets its own)."""
    optimizer = optax.adam(1e-3)
    tokens, targets = next(batches(vocab=ARGS[0], batch=2, seq=16))

    def model():
        return Model(*ARGS, key=jax.random.key(0))

    plain = eo.train_step(cross_entropy, optimizer, eo.Policy.none())
    state = eo.init_opt_state(optimizer, model(), eo.Policy.none())
    m0, _, loss0 = plain(model(), state, tokens, targets)
    placed = tight.place(model())
    m1, _, loss1 = tight.train_step()(
        placed, tight.init_opt_state(placed), tokens, targets
    )
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    leaves = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (m0, m1)]
    for a, b in zip(*leaves, strict=True):  # (Adam's first step: sign-like)
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    # The plan's parameters stay where its policy puts them.
    params = tight.policy.params
    assert isinstance(params, tuple)
    kinds = {x.sharding.memory_kind for x in leaves[1]}
    assert kinds == {kind for _, kind in params}


def test_a_local_search_improves_on_the_best_preset(monkeypatch):
    # No single moves compiled: the presets, then one knob at a time from the best
    # of them (`offload_all`), towards the device within the budget.
    monkeypatch.setattr(_plan, "SINGLES", 0)
    p = _v5e_plan(device_budget=BUDGET)
    rows = p.table.rows
    preset = next(r for r in rows if r.label.endswith("Policy.offload_all()"))
    chosen = next(r for r in rows if r.status == "chosen")
    assert preset.fits and chosen.fits and chosen is not preset
    assert chosen.seconds is not None and preset.seconds is not None
    assert chosen.seconds < preset.seconds
    compiled = [r for r in rows if r.status in ("chosen", "compiled")]
    assert len(compiled) == p.compiled <= 4 + _plan.IMPROVE_COMPILES
    assert all(r.fits for r in compiled[4:])  # each step kept within the budgets


def test_nothing_fits_names_the_smallest_footprint_and_the_budget(monkeypatch):
    monkeypatch.setattr(_plan, "SINGLES", 1)
    monkeypatch.setattr(_plan, "IMPROVE_COMPILES", 1)
    with pytest.raises(eo.DoesNotFit, match="over the device budget") as e:
        _v5e_plan(device_budget=MIB)
    assert e.value.available_bytes == MIB
    assert e.value.required_bytes is not None and e.value.required_bytes > MIB
    assert "smallest device footprint found" in str(e.value)


def test_budgets():
    assert _budget.parse_bytes("16GiB", "device_budget") == 16 * 2**30
    assert _budget.parse_bytes("48GB", "host_budget") == 48 * 10**9
    assert _budget.parse_bytes(" 1.5 MiB", "device_budget") == int(1.5 * MIB)
    assert _budget.parse_bytes(4096, "device_budget") == 4096
    for bad in ("16 apples", "0GB", -1, True, "GiB"):
        with pytest.raises(ValueError, match=r"`plan\(device_budget="):
            _budget.parse_bytes(bad, "device_budget")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="give both budgets"):
        eo.plan(cross_entropy, optax.adam(1e-3), _abstract(), TOKENS, TOKENS)
