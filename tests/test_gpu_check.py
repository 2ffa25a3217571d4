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
import gzip
import importlib.util
import io
import json
import math
import sys
import time
from pathlib import Path

import pytest

import eqx_offload as eo


SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    return gpu_check


def _here(gpu_check, parts, in_a_process=()):
    """`gpu_check.run_child` that runs each part in this process (through the same
    `child` and result line), but those named `in_a_process`, as `gpu_check.py`
    runs every part; the parts' names appended to `parts`."""
    child_process = gpu_check.run_child

    def run_child(argv, timeout, env=None):
        parts.append(argv[0])
        if argv[0] in in_a_process:
            return child_process(argv, timeout, env)
        start, printed = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            gpu_check.child(argparse.Namespace(child=argv, steps=3))
        (line,) = [x for x in printed.getvalue().splitlines() if gpu_check.MARK in x]
        result = json.loads(line[len(gpu_check.MARK) :])
        return {"result": result, "seconds": round(time.perf_counter() - start, 1)}

    return run_child


def _program(json_path, name):
    """The text of a saved program the results at `json_path` name."""
    with gzip.open(json_path.parent / name, "rt") as f:
        return f.read()


def test_the_gpu_check_runs_on_a_cpu(tmp_path, monkeypatch, gpu_check):
    out = tmp_path / "gpu_check.json"
    configs = ["offload_all, host update"]
    parts = []
    run_child = _here(gpu_check, parts, in_a_process=("bandwidth",))
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
    assert alone["host agrees with device (leaf scale, tol 1e-4)"] is True
    assert alone["control caught (>= 10x the tolerance)"] is True
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
    # The programs timed and compiled without a GPU, saved beside the results.
    assert run["program"] == "gpu_check.programs/smoke-offload-all-host-update.hlo.gz"
    assert _program(out, run["program"]).startswith("HloModule jit__step")
    deviceless = _program(out, run["deviceless gpu-h200 program"])
    assert deviceless.startswith("HloModule") and "S(5)" in deviceless
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


def test_the_calibration_and_the_overlap_probes_run_on_a_cpu(
    tmp_path, monkeypatch, gpu_check
):
    """`--calibrate` and `--overlap` at tiny sizes (every part here), each writing
    its file: the calibration in the format `Hardware.from_measurements` reads,
    every rate finite and positive; the probes' overlap shares; the step's three
    configurations, parameters checked against the first's; the profiled step."""
    out = tmp_path / "link.json"
    parts = []
    monkeypatch.setattr(gpu_check, "run_child", _here(gpu_check, parts))
    # The step of the test above (its programs read back from the compilation
    # cache), and again with XLA's flag (which a process of its own would set).
    configs = ["offload_all, host update"]
    configs.append("offload_all, host update, pipelined host offloading")
    argv = ["gpu_check.py", "--calibrate", "--overlap", "--smoke", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ["--configs", *configs])
    gpu_check.main()
    assert parts == ["link", "measure", "measure", "profile", "link", "host update"]
    calibration = json.loads((tmp_path / "link.calibrate.json").read_text())
    assert calibration["format"] == "eqx_offload calibration"
    assert calibration["version"] == 1
    assert calibration["target"] == "cpu" and calibration["device"] == "cpu"
    assert calibration["versions"]["jax"] and calibration["date"][:2] == "20"
    rates = [
        "host_to_device_bytes_per_second",
        "device_to_host_bytes_per_second",
        "both_ways_bytes_per_second",
        "host_memory_bytes_per_second",
        "matmul_flops_bf16",
    ]
    for key in rates:
        assert math.isfinite(calibration[key]) and calibration[key] > 0, key
    assert 0.0 <= calibration["transfer_overlap"] <= 1.0
    assert calibration["details"]["missing"] == []
    # What `eo.Hardware` reads of it (a GPU's: the CPU has no row in the table).
    gpu = tmp_path / "as_if_a_gpu.json"
    gpu.write_text(json.dumps({**calibration, "target": "gpu-h200"}))
    hardware = eo.Hardware.from_measurements(gpu)
    rate = calibration["both_ways_bytes_per_second"]
    assert hardware.both_ways_bytes_per_second == rate
    assert hardware.label("host_to_device_bytes_per_second") == "measured"
    overlap = json.loads((tmp_path / "link.overlap.json").read_text())
    probes = overlap["probes"]
    pairs = [k for k in probes if k.startswith("(")]
    assert [k.split()[0] for k in pairs] == [
        "(d)",
        "(a)",
        "(b)",
        "(b')",
        "(b'')",
        "(c)",
    ]
    for key in pairs:
        assert 0.0 <= probes[key]["overlap share"] <= 1.0, key
        assert probes[key]["both s"] > 0
        for name in probes[key]["programs"]:
            assert _program(out, name).startswith("HloModule jit_probe_")
    # The first configuration is the reference: the others' parameters after two
    # steps are compared with its (here the same programs: equal).
    reference, *others = overlap["steps"]
    assert [r["config"] for r in overlap["steps"]] == configs
    assert "saved" in reference["parameters after 2 steps"]
    for row in overlap["steps"]:
        assert "error" not in row and row["step s median"] > 0
        assert _program(out, row["program"]).startswith("HloModule jit__step")
    for row in others:
        assert row["parameters after 2 steps"]["close (1e-6)"]
    # No GPU here: the profile is read, and has no `Stream #` lines.
    profile = overlap["profile"]
    assert profile["step s median (not profiled)"] > 0
    assert "no `Stream #` events" in profile["note"]


def test_a_profile_gives_the_share_of_copies_under_kernels_and_each_other(tmp_path):
    """What `--overlap` reads of a GPU's profile, from a trace viewer's file (as
    `jax.profiler` writes beside its `.xplane.pb`): per `Stream #` line, memcpy
    events against kernels on any stream, and one direction against the other."""
    sys.path.insert(0, str(SCRIPT.parent))
    import _gpu_probes as probes

    def event(tid, name, start, end):
        return {
            "ph": "X",
            "pid": 1,
            "tid": tid,
            "name": name,
            "ts": start,
            "dur": end - start,
        }

    names = {
        7: "Stream #7(Kernel)",
        8: "Stream #8(MemcpyH2D)",
        9: "Stream #9(MemcpyD2H)",
    }
    trace = [
        {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": n}}
        for tid, n in names.items()
    ] + [
        event(7, "gemm_fusion", 0, 10),
        event(8, "MemcpyH2D", 5, 15),  # 5 of 10 under a kernel; 3 under the D2H
        event(9, "MemcpyD2H", 12, 20),  # 2 of 8 under a kernel
        event(7, "loop_dynamic_slice_fusion", 18, 25),
        event(3, "MemcpyH2D", 0, 100),  # not on a `Stream #` line: not counted
    ]
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": trace}, f)
    read = probes.read_profile(tmp_path)
    assert read["copy time overlapping kernels"] == pytest.approx(7 / 18)
    assert read["H2D time overlapping D2H"] == pytest.approx(3 / 10)
    assert read["H2D s"] == pytest.approx(10e-6) and read["D2H s"] == pytest.approx(
        8e-6
    )
    assert read["kernel busy s"] == pytest.approx(17e-6)
    assert read["dynamic-slice kernels s"] == pytest.approx(7e-6)
    assert read["streams (events by kind)"]["Stream #8(MemcpyH2D)"] == {"H2D": 1}
