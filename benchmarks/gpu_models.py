"""Public model shapes on one GPU: GPT-2 XL and a Mistral-7B-shaped model, their
whole train step (fp32, AdamW, batch 8 x 1024 tokens) compiled for one H100 and one
H200 under each preset, without a GPU (JAX's CUDA plugin, the `gpu-aot` extra).

    python benchmarks/gpu_models.py [--targets gpu-h100 gpu-h200] [--json FILE]

- GPT-2 XL: vocab 50257, dim 1600, 48 blocks of LayerNorm, 25-head attention and a
  GELU MLP (6400), biases, 1024 learned positions, the table tied to the head:
  1.56e9 parameters.
- Mistral-7B-shaped: vocab 32000, dim 4096, 32 blocks of RMSNorm, grouped-query
  attention (32 query heads, 8 key/value heads, head dim 128, RoPE) and a SwiGLU
  MLP (14336), an untied head: 7.24e9 parameters.

Both with the plain loss (the full logits), attention 256 queries at a time as a
fused kernel would (`models/decoder.py`). A GPU "fits" a step when its device
footprint is
within the 75% of its memory JAX's allocator takes (`XLA_PYTHON_CLIENT_MEM_FRACTION`);
the host column is what one GPU's host must hold (pinned).
"""

import time
from typing import Any

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
from _common import GIB, parser, table, write_json
from models import decoder
from models.decoder import plain_loss, Shape
from models.shapes import BATCH, GPU_MODELS as MODELS, SEQ

import eqx_offload as eo


PRESETS = ("none", "remat", "offload_residuals", "offload_all")


def report(shape: Shape, preset: str, target: str) -> eo.MemoryReport:
    policy = getattr(eo.Policy, preset)()
    return decoder.step_report(
        shape, policy, plain_loss, target=target, batch=BATCH, seq=SEQ
    )


def main():
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["gpu-h100", "gpu-h200"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    parameters = {}
    for name in args.models:
        shape = MODELS[name]
        parameters[name] = decoder.parameters(shape)
        print(f"{name}: {parameters[name] / 1e9:.3f}e9 parameters", flush=True)
        for target in args.targets:
            for preset in args.presets:
                start = time.perf_counter()
                row: dict[str, Any] = {"model": name, "target": target}
                row["preset"] = preset
                try:
                    r = report(shape, preset, target)
                except eo.DoesNotFit as e:
                    need, have = e.required_bytes or 0, e.available_bytes or 0
                    row.update(
                        {
                            "device GiB": None,
                            "host GiB": None,
                            "capacity GiB": have / GIB,
                            "fits": False,
                            "note": f"needs {need / GIB:.2f} of {have / GIB:.2f}",
                        }
                    )
                else:
                    row.update(
                        {
                            "device GiB": r.device_bytes / GIB,
                            "host GiB": r.host_bytes / GIB,
                            "capacity GiB": (r.capacity or 0) / GIB,
                            "fits": r.fits_device,
                            "note": "",
                            "H2D GiB/step": r.host_to_device_bytes / GIB,
                            "D2H GiB/step": r.device_to_host_bytes / GIB,
                        }
                    )
                row["compile s"] = round(time.perf_counter() - start, 1)
                rows.append(row)
                print(row, flush=True)
    headers = ["model", "target", "preset", "device GiB", "host GiB", "fits", "note"]
    print(table(headers, [[r.get(h) for h in headers] for r in rows]))
    write_json(args.json, "gpu_models", {"parameters": parameters, "rows": rows})


if __name__ == "__main__":
    main()
