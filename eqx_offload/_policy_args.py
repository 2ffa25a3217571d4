"""The checks of `Policy`'s arguments, and the messages of its renamed and
experimental ones."""

from collections.abc import Sequence
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from . import _paths
from ._errors import see
from ._warn import warn_at_caller


def name_patterns(value: Any, argument: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        paths = argument in ("keep_dtype", "host_tables")
        what = "leaf-path patterns" if paths else "checkpoint names"
        raise TypeError(
            f"`Policy({argument}=...)` must be a sequence of {what} (strings), got "
            f"{value!r}." + see(20)
        )
    for name in value:
        if not name or name != name.strip():
            raise ValueError(
                f"`Policy({argument}=...)` contains {name!r}. Names are non-empty, "
                "without surrounding spaces."
            )
    return tuple(value)


def check_compute_dtype(value: Any) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`Policy(compute_dtype={value!r})` must be a floating-point dtype such "
            "as `jnp.bfloat16`, or None." + see(89)
        )
    return dtype


class ExperimentalWarning(UserWarning):
    """A `Policy` uses an experimental feature: `prefetch=1`,
    `update_timing="next_forward"` or `update="host"`.

    Each warns once per process, saying what it measured and its main risk. Silence
    them with `warnings.simplefilter("ignore", eqx_offload.ExperimentalWarning)`.
    """


# Each experimental setting, and what it warns once per process.
EXPERIMENTAL = {
    ("prefetch", 1): "`Policy(prefetch=1)` is experimental: on an H200 it measured "
    "no gain (173.6 ms a step against 173.3 ms), for one more layer of device "
    "memory. See docs/benchmarks/prefetch.md.",
    ("update_timing", "next_forward"): "`Policy(update_timing='next_forward')` is "
    "experimental: on an H200 it measured 0.9-3.3% faster. The model a step returns "
    "is one update behind until `eqx_offload.apply_pending`, and with micro-batches "
    "or `compute_dtype` the update runs before the loss, hiding nothing. See "
    "docs/benchmarks/update-timing.md.",
    ("update", "host"): "`Policy(update='host')` is experimental: on an H200 it "
    "measured 2.75x slower than the streamed update (476.6 ms a step against "
    "173.3 ms), with 1.8x the host memory. See docs/benchmarks/host-update.md.",
}
WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """An `ExperimentalWarning` at the user's line, once per process per message."""
    if message not in WARNED:
        WARNED.add(message)
        warn_at_caller(message, ExperimentalWarning)


# The old keywords of `Policy(...)`: the message naming the new one.
RENAMED = {
    "stream": "`Policy(stream=...)` is now `Policy(host_tables=...)`. Rename the "
    "keyword (the attribute too: `policy.host_tables`)." + see(140),
}
# The valid values of each mode option, with the entry of its error.
CHOICES = {
    "update": (("auto", "streamed", "whole", "host"), 23),
    "update_timing": (("now", "next_forward"), 135),
    "loss_axes": (("auto", "explicit"), 26),
}


def check_choice(name: str, value: Any) -> None:
    valid, number = CHOICES[name]
    if value not in valid:
        *rest, last = map(repr, valid)
        raise ValueError(
            f"`Policy({name}={value!r})`: valid values are {', '.join(rest)} and "
            f"{last}." + see(number)
        )


def check_save_and_offload(
    save: Literal["all"] | tuple[str, ...], offload: tuple[str, ...]
) -> None:
    if save == "all":
        if offload:
            raise ValueError(
                f"`Policy(save='all')` keeps every residual, so `offload={offload!r}` "
                "never applies. Drop `offload`." + see(21)
            )
        return
    both = [n for n in save if _paths.is_literal(n) and n in offload]
    if both:
        raise ValueError(
            f"`Policy`: {_paths.quoted(both)} is in both `save` and `offload`. Keep "
            "it in one." + see(21)
        )


LAYER_INPUTS = ("**.input",)


def check_replaced(preset: str, overrides: dict[str, Any]) -> None:
    """Warns when `offload=` replaces a preset's `("**.input",)` without keeping it.

    The preset then no longer offloads the carry entering each layer. That is easy to
    miss.
    """
    given = overrides.get("offload", LAYER_INPUTS)
    given = (given,) if isinstance(given, str) else given
    if isinstance(given, Sequence) and LAYER_INPUTS[0] not in given:
        names = tuple(given)
        host = "params='pinned_host', opt_state='pinned_host', "
        host = host if preset == "offload_all" else ""
        written = f"Policy({host}offload={names!r})"
        warn_at_caller(
            f"`Policy.{preset}(offload={names!r})` replaces the preset's "
            f"`offload={LAYER_INPUTS!r}`: the carry entering each layer "
            "('<path>.input') is no longer offloaded but kept on the device. To "
            f"offload both, write `offload=({LAYER_INPUTS[0]!r}, ...)`; to "
            f"offload only these names, write the policy out: `{written}`." + see(25)
        )
