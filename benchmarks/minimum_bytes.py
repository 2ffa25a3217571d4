"""The fewest bytes a train step must move between host and device memory, per
update mode (`whole`, `streamed`, `host`), parameter placement and compute dtype:
per parameter of a stacked layer (fp32 master, AdamW), and in GB per step for the
Llama-3.2-1B shape of `benchmarks/llama.py` (batch 8 x 1024 tokens). The rules are
the test oracle's, `tests/minimum_traffic.py` (not public API). `compile_matrix.py`
compiles each row for `tpu-v5e` and `gpu-h100` against it (the command is in
docs/step-time.md), and `tests/test_minimum_traffic.py` a covering six.

    python benchmarks/minimum_bytes.py [--json FILE]
"""

import sys
from pathlib import Path

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from _common import parser, table, write_json
from models.decoder import Decoder
from models.shapes import BATCH, LLAMA_3_2_1B, SEQ

import eqx_offload as eo


sys.path.insert(0, str(Path(__file__).parents[1]))  # the repository, for `tests`
from tests.minimum_traffic import minimum_traffic, MinimumTraffic  # noqa: E402


UPDATES = ("whole", "streamed", "host")
# placement -> the policy's preset and overrides
PLACEMENTS = {
    "parameters and state on the host": ("offload_all", {}),
    "parameters on the device, state on the host": (
        "offload_residuals",
        {"opt_state": "pinned_host"},
    ),
}
DTYPES = ("float32", "bfloat16")


def policy(update: str, placement: str, dtype: str) -> eo.Policy:
    """The policy of one row: `placement`'s preset, `update`, and under
    `"bfloat16"` `compute_dtype=jnp.bfloat16` (the masters stay float32)."""
    preset, overrides = PLACEMENTS[placement]
    compute = {"compute_dtype": jnp.bfloat16} if dtype == "bfloat16" else {}
    return getattr(eo.Policy, preset)(update=update, **overrides, **compute)


def minimum(model, update: str, placement: str, dtype: str, **kwargs):
    """The oracle's minimum for an abstract `model` under a row's policy (AdamW)."""
    optimizer = optax.adamw(1e-3)
    p = policy(update, placement, dtype)
    model = eo.place(model, p)
    opt_state = eo.init_opt_state(optimizer, model, p)
    return minimum_traffic(model, opt_state, p, optimizer, **kwargs)


def stacked_layer(width: int = 2048, layers: int = 2):
    """A `Stacked` of `layers` square matrices: every parameter in a stacked
    layer, as the per-parameter table assumes."""
    key = jax.random.key(0)

    def make():
        return eo.Stacked.from_fn(
            lambda k: eqx.nn.Linear(width, width, use_bias=False, key=k),
            layers,
            key=key,
        )

    return eqx.filter_eval_shape(make)


def _per(n: int, parameters: int) -> str:
    return f"{n / parameters:.2f}".rstrip("0").rstrip(".")


def per_parameter_rows() -> list[list[str]]:
    """Bytes per parameter per step of a stacked layer, each way (residuals apart:
    they do not scale with the parameters)."""
    model = stacked_layer()
    n = sum(x.size for x in jax.tree.leaves(model))
    rows = []
    for update in UPDATES:
        for placement in PLACEMENTS:
            for dtype in DTYPES:
                m = minimum(model, update, placement, dtype)
                rows.append(
                    [
                        f"`{update}`",
                        placement,
                        dtype,
                        _per(m.host_to_device, n),
                        _per(m.device_to_host, n),
                        _parts(m, n),
                    ]
                )
    return rows


def _parts(m: MinimumTraffic, n: int) -> str:
    """Which parts the bytes are: parameters, gradients, optimizer state."""
    out = []
    for what, label in (
        ("params", "params"),
        ("gradients", "grad"),
        ("opt_state", "state"),
    ):
        h2d, d2h = getattr(m, f"{what}_to_device"), getattr(m, f"{what}_to_host")
        if h2d or d2h:
            out.append(f"{label} {_per(h2d, n)} / {_per(d2h, n)}")
    return "; ".join(out)


def llama_rows() -> list[list[str]]:
    """GB per step of the Llama-3.2-1B shape with every parameter and the state
    on the host, per update mode and dtype; the offloaded layer inputs apart."""
    model = eqx.filter_eval_shape(Decoder, LLAMA_3_2_1B, key=jax.random.key(0))
    rows = []
    for update in UPDATES:
        for dtype in DTYPES:
            # The carry entering each block (`"blocks.input"`), saved in the dtype
            # the layers compute in.
            size = 2 if dtype == "bfloat16" else 4
            carry = LLAMA_3_2_1B.layers * BATCH * SEQ * LLAMA_3_2_1B.dim * size
            m = minimum(
                model,
                update,
                "parameters and state on the host",
                dtype,
                residual_bytes=carry,
            )
            rows.append(
                [
                    f"`{update}`",
                    dtype,
                    f"{m.bytes('host_to_device', residuals=False) / 1e9:.1f}",
                    f"{m.bytes('device_to_host', residuals=False) / 1e9:.1f}",
                    f"{m.residuals_to_device / 1e9:.2f}",
                ]
            )
    return rows


PER_PARAMETER = [
    "update",
    "placement",
    "compute dtype",
    "to device",
    "to host",
    "of which (to device / to host)",
]
LLAMA = [
    "update",
    "compute dtype",
    "to device (GB)",
    "to host (GB)",
    "residuals (GB, each way)",
]


def main():
    args = parser(__doc__).parse_args()
    per, llama = per_parameter_rows(), llama_rows()
    print("Bytes per parameter per step, a stacked layer (fp32 master, AdamW):\n")
    print(table(PER_PARAMETER, per))
    print("\nThe Llama-3.2-1B shape, parameters and state on the host, per step:\n")
    print(table(LLAMA, llama))
    write_json(
        args.json,
        "minimum_bytes",
        {
            "per_parameter": [dict(zip(PER_PARAMETER, r)) for r in per],
            "llama_3_2_1b": [dict(zip(LLAMA, r)) for r in llama],
        },
    )


if __name__ == "__main__":
    main()
