"""`benchmarks/gpu_check.py`, the one command for a real GPU, runs on this CPU with
`--smoke`: every part in a process of its own, its results recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_runs_on_a_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    configs = ["none", "offload_all, whole update"]
    command = [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [*command, "--configs", *configs], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["smoke"] and results["versions"]["jax"]
    assert results["environment"]["backend"] == "cpu"
    # Numerics: every configuration against plain training, `eo.verify`, placements
    # and the offloaded scan, all passing (each part recorded, not just the verdict).
    numerics = results["numerics"]
    assert numerics["passed"], numerics
    assert set(numerics["presets"]) == {
        "none",
        "remat",
        "offload_residuals",
        "offload_all, streamed update",
        "offload_all, whole update",
    }
    for row in numerics["presets"].values():
        assert row["verify passed"] and row["placements kept"]
        assert row["max |params - plain|"] <= 1e-4
    scans = numerics["offloaded scan (openxla/xla#46231)"]
    assert set(scans) == {"scan", "reversed scan"}
    assert all(s["passed"] and s["scale"] > 0 for s in scans.values())
    link = results["host link"]
    assert link["pinned host -> device GB/s"] > 0 < link["device -> pinned host GB/s"]
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
    assert runs["none"]["parameter memory kinds"] == ["device"]
    assert runs["offload_all, whole update"]["parameter memory kinds"] == [
        "pinned_host"
    ]
    assert runs["offload_all, whole update"]["deviceless gpu-h200 host bytes"] > 0
    # The order of the configurations by measured time; no estimate to compare on
    # the CPU.
    order = results["time order"]["smoke"]
    assert sorted(order["step s median"]) == sorted(configs)
    assert "estimated step s" not in order


def test_the_time_order_compares_measured_and_estimated():
    """What a GPU run records of its estimates: the configurations fastest first,
    measured and estimated, and whether the orders agree."""
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_check

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
