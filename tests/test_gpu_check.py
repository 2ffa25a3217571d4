"""`benchmarks/gpu_check.py`, the one command for a real GPU, runs on this CPU with
`--smoke` and one configuration (`offload_all` with the update on the host's CPU,
`update="host"`): every part run (one in a process of its own, as on a GPU
each is; the others in this process, to compile less), its results recorded.
The script's verdicts on training against plain training (AdamW, tolerances
chosen for a GPU, not by construction) are its business on a GPU; here the ones
that hold by construction are checked (`eo.verify`, placements, host compute, the
offloaded scan's gradient, the host update's two forms agreeing), and that every
figure is recorded."""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import sys
import time
from pathlib import Path

import pytest


SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    return gpu_check


def test_the_gpu_check_runs_on_a_cpu(tmp_path, monkeypatch, gpu_check):
    out = tmp_path / "gpu_check.json"
    configs = ["offload_all, host update"]
    in_a_process = gpu_check.run_child
    parts = []

    def run_child(argv, timeout, env=None):
        """The host link's part in a child process, as `gpu_check.py` runs every
        part; the others here, through the same `child` and result line."""
        parts.append(argv[0])
        if argv[0] == "bandwidth":
            return in_a_process(argv, timeout, env)
        start, printed = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            gpu_check.child(argparse.Namespace(child=argv, steps=3))
        (line,) = [x for x in printed.getvalue().splitlines() if gpu_check.MARK in x]
        result = json.loads(line[len(gpu_check.MARK) :])
        return {"result": result, "seconds": round(time.perf_counter() - start, 1)}

    monkeypatch.setattr(gpu_check, "run_child", run_child)
    monkeypatch.setattr(
        sys,
        "argv",
        ["gpu_check.py", "--smoke", "--json", str(out), "--configs", *configs],
    )
    gpu_check.main()
    assert parts == [
        "numerics",
        "bandwidth",
        "flag",
        "deviceless",
        "host update",
        "measure",
    ]
    results = json.loads(out.read_text())
    assert results["smoke"] and results["versions"]["jax"]
    assert results["environment"]["backend"] == "cpu"
    # Numerics: each configuration against plain training, `eo.verify`, placements
    # and the offloaded scan (each part recorded, not just the verdict).
    numerics = results["numerics"]
    assert isinstance(numerics["passed"], bool)
    assert set(numerics["presets"]) == set(configs)
    for row in numerics["presets"].values():
        assert "error" not in row, row
        assert row["verify passed"] and row["placements kept"]
        assert math.isfinite(row["max |params - plain|"])
        assert math.isfinite(row["max |loss - plain|"])
    # The update on the host's CPU, parameters on the host and on the device, with
    # AdamW behind a global-norm clip that clipped every step, against
    # `Policy.none()`'s step.
    host = numerics["host update, AdamW + clip_by_global_norm"]
    assert set(host) == {
        "offload_all(update='host')",
        "remat(opt_state='pinned_host', update='host')",
    }
    for row in host.values():
        assert "error" not in row, row
        assert row["verify passed"] and row["placements kept"] and row["host compute"]
        assert row["clipped every step"] and row["smallest gradient norm"] > 0.1
        assert math.isfinite(row["max |loss - plain| / |plain|"])
        assert math.isfinite(row["max |params - plain|"])
    scans = numerics["offloaded scan (openxla/xla#46231)"]
    assert set(scans) == {"scan", "reversed scan"}
    # Scale-relative, at `tests/numerics.py`'s `F32`: the same gradient computed
    # with and without the offload.
    assert all(s["passed"] and s["scale"] > 0 for s in scans.values())
    link = results["host link"]
    assert link["pinned host -> device GB/s"] > 0 < link["device -> pinned host GB/s"]
    # The host update alone, in both forms of host compute jax 0.10 has, against
    # the same update on the device: timed, the same numbers, still on the host.
    (alone,) = results["host update"].values()
    assert alone["forms agree"], alone  # exactly
    assert set(alone["forms"]) == {"decorator", "context"}
    for form in alone["forms"].values():
        assert form["update s median"] > 0 < form["host memory GB/s"]
        assert form["memory kinds after"] == ["pinned_host"]
    assert alone["forms"]["context"]["max |update - first form's|"] == 0.0
    assert isinstance(alone["host agrees with device (rtol 1e-5)"], bool)
    assert alone["device update s median"] > 0 < alone["host / device"]
    assert alone["host memory bytes per update"] == 28 * alone["parameters"]
    # XLA's flag for host compute on a GPU: a compile option this jaxlib takes, and
    # a made-up one it refuses; for a compile-only H100 when the plugin is here.
    flag = results["xla_gpu_enable_pipelined_host_offloading"]
    assert flag["cpu"]["accepted"] and not flag["cpu"]["made-up flag accepted"]
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is not None:
        h100 = flag["gpu-h100 (compile-only)"]
        assert h100["accepted"] and not h100["made-up flag accepted"], h100
        assert h100["host compute in the program"]
    # One fresh process per configuration: the step timed, the reports side by side.
    runs = {r["config"]: r for r in results["runs"]}
    assert list(runs) == configs
    for config, run in runs.items():
        assert "error" not in run, run
        assert run["step s median"] > 0 and run["report device bytes"] > 0
        assert run["deviceless gpu-h200 device bytes"] > 0
        # The estimate next to the measured time: none on the CPU backend, the
        # deviceless H200 compile's otherwise.
        assert run["estimated step s"] is None and "estimate / measured" not in run
        assert run["deviceless gpu-h200 estimated step s"] > 0
    (run,) = runs.values()
    assert run["parameter memory kinds"] == ["pinned_host"]
    assert run["host compute"]
    assert run["deviceless gpu-h200 host bytes"] > 0
    # The order of the configurations by measured time; no estimate to compare on
    # the CPU.
    order = results["time order"]["smoke"]
    assert sorted(order["step s median"]) == sorted(configs)
    assert "estimated step s" not in order


def test_the_time_order_compares_measured_and_estimated(gpu_check):
    """What a GPU run records of its estimates: the configurations fastest first,
    measured and estimated, and whether the orders agree."""

    def run(config, measured, estimated, linked):
        return {
            "size": "GPT 0.2B",
            "config": config,
            "step s median": measured,
            "estimated step s": estimated,
            "estimated step s, measured link": linked,
        }

    runs = [
        run("none", 1.0, 0.9, 0.9),
        run("remat", 1.2, 1.1, 1.1),
        run("offload_all", 2.0, 1.0, 2.5),
        {"size": "GPT 0.9B", "config": "none", "error": "skipped"},
    ]
    order = gpu_check.time_order(runs)
    small = order["GPT 0.2B"]
    assert small["step s median"] == ["none", "remat", "offload_all"]
    assert small["estimated step s"] == ["none", "offload_all", "remat"]
    assert small["same order (estimated step s)"] is False
    assert small["same order (estimated step s, measured link)"] is True
    assert order["GPT 0.9B"] == {}
