"""Memory budgets as users write them (bytes, or strings such as `"16GiB"`), and
what to change when a step exceeds them."""

import re
from collections.abc import Sequence

from .._errors import see


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value: int | str, argument: str) -> int:
    """`value` in bytes: an int, or a number and a unit (`"16GiB"`, `"48 GB"`,
    `"1.5TiB"`); anything else is a `ValueError` naming `argument`."""
    if isinstance(value, bool):
        value = -1
    if isinstance(value, int):
        if value > 0:
            return value
    elif isinstance(value, str):
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", value, re.I)
        if found is not None:
            n = float(found[1]) * _UNITS[(found[2] or "").upper()]
            if n >= 1:
                return int(n)
    raise ValueError(
        f"`plan({argument}={value!r})` is not a size. Give positive bytes: an int, "
        "or a string such as '16GiB'." + see(114)
    )


def fixes(exceeded: Sequence[str]) -> str:
    """What would let a step fit the budgets it exceeds (`"device"`, `"host"`),
    as `plan` and `fewest_chips` advise it: only what changes that memory (more
    offloading or micro-batches add nothing to the host's room)."""
    out = []
    if "device" in exceeded:
        out.append(
            "a larger `device_budget`, a smaller batch or model, or micro-batches "
            "(`microbatches=(1, 2, 4)`)"
        )
    if "host" in exceeded:
        out.append(
            "a larger `host_budget`, Adam's first moment in bfloat16 "
            "(`optax.adamw(..., mu_dtype=jnp.bfloat16)`), or a smaller model"
        )
    return "; for the host, ".join(out)
