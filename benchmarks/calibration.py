"""The step-time model against the 11 steps measured on an H200: its parameters
fitted on the 0.2B steps, the 0.9B steps held out.

`python benchmarks/calibration.py --json benchmarks/results/calibration.json`
(≈ 10 s, no GPU). It reads the programs those steps compiled
(`tests/fixtures/h200_steps/`, compiled without a GPU for `gpu-h200` from the code
that ran them, by `benchmarks/h200_programs.py`) and what each step measured
(their `manifest.json`, from `benchmarks/results/gpu_check_h200_gpt0{2,9}b.json`).
Then it fits, on the seven 0.2B steps only:

- `compute_efficiency`: the 0.2B `remat` step (device work only) estimated at the
  roofline's peak, over its measured step;
- `transfer_overlap`: from a grid (a share of 0, 0.25, ..., 1), the one whose
  largest error over the 0.2B steps that move bytes over the link is smallest
  (`both_ways_bytes_per_second` cannot be fitted: no step had both directions in
  flight at once, so full duplex and taking turns price them alike);

with the link's rates and the host update's memory rate as the run measured them
(`eqx_offload/_report/_hardware.py`, `H200_MEASURED`). It prints, for all 11 steps,
the estimate, the measured step and their ratio, and the largest error by kind of
step: the `H200_ERROR` the table gives. tests/test_calibration.py checks that the
table's H200 row is this fit, and every ratio within 0.8-1.25.
"""

import dataclasses
import gzip
import json
import math
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))
from _common import parser, table, write_json  # noqa: E402


FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures" / "h200_steps"
OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)
FITTED_ON = "GPT 0.2B"


def steps() -> list[dict]:
    """The measured steps, each with its parsed program (`"program"`)."""
    from eqx_offload import internal as eoi

    rows = json.loads((FIXTURES / "manifest.json").read_text())
    out = []
    for row in rows:
        text = gzip.decompress((FIXTURES / row["file"]).read_bytes()).decode()
        out.append({**row, "program": eoi.Program(text, "gpu")})
    return out


def price(step: dict, hardware) -> float:
    from eqx_offload import internal as eoi

    return eoi.step_time_estimate(step["program"], hardware, "gpu").seconds


def _worst(ratios: list[float]) -> float:
    return max(abs(math.log(r)) for r in ratios)


def fit(rows: list[dict]):
    """The H200's `Hardware`, its model's parameters fitted to `rows` (the 0.2B
    steps), starting from the table's row with the parameters reset."""
    import eqx_offload as eo

    base = dataclasses.replace(
        eo.Hardware.of("gpu-h200"),
        compute_efficiency=1.0,
        transfer_overlap=1.0,
    )
    (remat,) = [r for r in rows if r["config"] == "remat"]
    efficiency = round(price(remat, base) / remat["measured step s"], 2)
    base = dataclasses.replace(base, compute_efficiency=efficiency)
    linked = [
        r for r in rows if r["config"] != "remat" and "host update" not in r["config"]
    ]
    grid = [dataclasses.replace(base, transfer_overlap=o) for o in OVERLAPS]
    return min(
        grid,
        key=lambda hw: _worst([price(r, hw) / r["measured step s"] for r in linked]),
    )


def errors(rows: list[dict], hardware) -> dict[str, float]:
    """The largest |estimate / measured - 1| by kind of step."""
    from eqx_offload import internal as eoi

    out: dict[str, float] = {}
    for row in rows:
        t = eoi.step_time_estimate(row["program"], hardware, "gpu")
        e = abs(t.seconds / row["measured step s"] - 1)
        out[t.kind] = max(out.get(t.kind, 0.0), e)
    return out


def main() -> None:
    import eqx_offload as eo

    p = parser(__doc__)
    args = p.parse_args()
    rows = steps()
    fitted = fit([r for r in rows if r["size"] == FITTED_ON])
    table_row = eo.Hardware.of("gpu-h200")
    results = []
    for row in rows:
        seconds = price(row, table_row)
        results.append(
            {
                "size": row["size"],
                "config": row["config"],
                "fitted on": row["size"] == FITTED_ON,
                "measured step ms": row["measured step s"] * 1e3,
                "estimated step ms": seconds * 1e3,
                "estimate / measured": seconds / row["measured step s"],
                "estimated step ms, uncalibrated": price(row, _uncalibrated()) * 1e3,
            }
        )
    found = {
        "compute_efficiency": fitted.compute_efficiency,
        "transfer_overlap": fitted.transfer_overlap,
    }
    print(
        table(
            ["model", "configuration", "fitted", "measured ms", "estimate ms", "ratio"],
            [
                [
                    r["size"],
                    r["config"],
                    "yes" if r["fitted on"] else "held out",
                    r["measured step ms"],
                    r["estimated step ms"],
                    r["estimate / measured"],
                ]
                for r in results
            ],
        )
    )
    print("fitted on the 0.2B steps:", found)
    print("largest error by kind:", errors(rows, table_row))
    write_json(
        args.json,
        "calibration",
        {"fitted": found, "errors": errors(rows, table_row), "rows": results},
    )


def _uncalibrated():
    """The H200 as the table gave it before the calibration: the links' nominal
    64 GB/s each way, full duplex, every transfer free to overlap, compute at
    peak, the host at 77 GB/s."""
    import eqx_offload as eo

    return dataclasses.replace(
        eo.Hardware.of("gpu-h200"),
        host_to_device_bytes_per_second=64e9,
        device_to_host_bytes_per_second=64e9,
        both_ways_bytes_per_second=None,
        transfer_overlap=1.0,
        compute_efficiency=1.0,
        host_memory_bytes_per_second=77e9,
        labels={},
    )


if __name__ == "__main__":
    main()
