"""Memory budgets as users write them (bytes, or strings such as `"16GiB"`), the
device memory left free for what a compile without the device cannot see
(`workspace_margin`), and what to change when a step exceeds them."""

import re
from collections.abc import Sequence

from .._errors import see


# Units, in capitals: kilo- to terabytes, in powers of 1000 and of 1024 ("KiB").
_UNITS = {"": 1, "B": 1} | {
    f"{prefix}{i}B": base ** (n + 1)
    for n, prefix in enumerate("KMGT")
    for i, base in (("", 1000), ("I", 1024))
}


def parse_bytes(value: int | str, argument: str) -> int:
    """`value` in bytes: an int, or a number and a unit (`"16GiB"`, `"48 GB"`,
    `"1.5TiB"`); anything else is a `ValueError` naming `argument`."""
    if isinstance(value, bool):
        value = -1
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, str):
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", value, re.I)
        if found is not None:
            if (n := float(found[1]) * _UNITS[(found[2] or "").upper()]) >= 1:
                return int(n)
    raise ValueError(
        f"`plan({argument}={value!r})` is not a size. Give positive bytes: an int, "
        "or a string such as '16GiB'." + see(114)
    )


# The device memory `plan` leaves free on a GPU target by default: what a compile
# without the GPU cannot see. It has no autotuning: the GEMMs get XLA's default
# configurations, whereas on the GPU the autotuner may pick a Triton split-K
# configuration, whose partial products (split_k x M x N in float32) are a scratch
# buffer the deviceless program lacks (a [2048, 8192] weight gradient split 16
# ways: 1 GiB), or cuBLASLt algorithms with their own workspace (NVIDIA's
# `cublasSetWorkspace` docs: 32 MiB a stream on Hopper, 4 MiB before). Its cuDNN
# calls get no workspace at all (fused attention, convolutions). JAX's allocator
# also holds what is not the step's program: the next batch copied in while a
# step runs, and the fragmentation of its pool. 2 GiB covers one large split-K
# scratch and those; it is 3.4% of an H100's default capacity (59.33 GiB) and 1.9%
# of an H200's. A TPU compile sees every buffer: no margin there.
GPU_MARGIN = 2 * 2**30
# A budget smaller than `GPU_MARGIN / MARGIN_SHARE` (16 GiB) keeps this share of
# it free instead.
MARGIN_SHARE = 1 / 8


def workspace_margin(value: int | str | None, budget: int, platform: str | None) -> int:
    """The device bytes to leave free under a `budget` of device memory:
    `value` (bytes, or a string such as `"1GiB"`; `0` for none), or by default
    `GPU_MARGIN` (or `MARGIN_SHARE` of a smaller budget) on a GPU and none
    elsewhere. A margin of the whole budget or more is a `ValueError`."""
    if value is None:
        return 0 if platform != "gpu" else min(GPU_MARGIN, int(budget * MARGIN_SHARE))
    zero = value == 0 and not isinstance(value, bool)
    margin = 0 if zero else parse_bytes(value, "workspace_margin")
    if margin >= budget:
        raise ValueError(
            f"`plan(workspace_margin={value!r})` leaves nothing of the device budget "
            f"({budget} bytes). Give a smaller margin, `0`, or a larger "
            "`device_budget`." + see(114)
        )
    return margin


# What `fixes` advises for each memory, in this order.
_FIXES = {
    "device": "a larger `device_budget`, a smaller batch or model",
    "host": "a larger `host_budget`, Adam's first moment in bfloat16 "
    "(`optax.adamw(..., mu_dtype=jnp.bfloat16)`), or a smaller model",
}
_MICROBATCHES = ', or micro-batches (`microbatches="search"`)'


def fixes(exceeded: Sequence[str], searched: bool = False) -> str:
    """What would let a step fit the budgets it exceeds (`"device"`, `"host"`),
    as `plan` and `fewest_chips` advise it: only what changes that memory (more
    offloading or micro-batches add nothing to the host's room; micro-batches
    not where they were `searched`)."""
    more = {"device": "" if searched else _MICROBATCHES, "host": ""}
    return "; for the host, ".join(_FIXES[m] + more[m] for m in _FIXES if m in exceeded)
