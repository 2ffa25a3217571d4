"""`MemoryReport.plot`: the parts it draws add up to the footprints."""

import functools
import json

import jax
import jax.numpy as jnp
import matplotlib
import optax
import pytest


matplotlib.use("Agg")

import eqx_offload as eo  # noqa: E402
from eqx_offload.internal import plot_categories

from .helpers import ProjectedStack, TanhBlock  # noqa: E402


def _model(key) -> ProjectedStack:
    """An input projection and three stacked `TanhBlock`s of width 64."""
    k1, k2 = jax.random.split(key)
    blocks = TanhBlock(jax.random.normal(k2, (3, 64, 64)))
    return ProjectedStack(jax.random.normal(k1, (16, 64)), eo.Stacked(blocks))


@pytest.fixture(scope="module")
def reports():
    """`reports(preset, target=None)`: the report of `Policy.<preset>()`'s train step
    of `_model` (Adam), compiled once in this module."""

    @functools.cache
    def compiled(preset: str, target: str | None = None) -> eo.MemoryReport:
        policy = getattr(eo.Policy, preset)()
        optimizer = optax.adam(1e-3)
        model = eo.place(_model(jax.random.key(0)), policy)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        step = eo.train_step(
            lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), optimizer, policy
        )
        x = jnp.ones((8, 16))
        return eo.memory_report(step, model, opt_state, x, target=target)

    return compiled


@pytest.mark.parametrize("target", [None, "tpu-v5e"])
def test_parts_add_up_to_the_footprints(reports, target):
    report = reports("offload_all", target)
    device, host = plot_categories(report, "device"), plot_categories(report, "host")
    assert sum(device.values()) == report.device_bytes
    assert sum(host.values()) == report.host_bytes
    assert all(v >= 0 for v in (*device.values(), *host.values()))
    assert host["parameters"] == (report.params or {})["pinned_host"]
    assert device["parameters"] == 0
    # The offloaded carries, as traced (temporaries of the device on the CPU).
    saved = (device if target is None else host)["saved: blocks.input"]
    assert saved > 0


def test_several_reports_side_by_side(reports, tmp_path):
    reports = [reports(p) for p in ("remat", "offload_all")]
    ax = reports[0].plot(reports[1], labels=["remat", "offload_all"], unit="KiB")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["device", "host"] * 2
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"parameters", "optimizer state", "saved: blocks.input"} <= labels
    ax.figure.savefig(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 0
    with pytest.raises(ValueError, match=r"2 reports\. Give one label per report"):
        reports[0].plot(reports[1], labels=["one"])
    with pytest.raises((ValueError, TypeError), match="unit"):
        reports[0].plot(unit="GB")  # type: ignore[arg-type]

    # A category has one colour in every figure (panels drawn apart can share a legend).
    def colours(ax):
        return {
            h.get_label(): h.get_facecolor() for h in ax.get_legend().legend_handles
        }

    one, both = colours(reports[1].plot()), colours(ax)
    assert all(both[name] == colour for name, colour in one.items())
    # By default, the largest unit in which the tallest bar is at least 1.
    tallest = max(max(r.device_bytes, r.host_bytes) for r in reports)
    unit = next(
        u for u, n in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 1024)) if tallest >= n
    )
    assert reports[0].plot(reports[1]).get_ylabel() == unit


def test_a_report_read_back_from_json_draws_the_same(reports):
    report = reports("offload_all", "tpu-v5e")
    again = eo.MemoryReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.to_dict() == report.to_dict()
    assert plot_categories(again, "device") == plot_categories(report, "device")
    with pytest.raises(ValueError, match="lacks device, estimate, host"):
        eo.MemoryReport.from_dict({"target": "tpu-v5e", "compiled": "function"})
