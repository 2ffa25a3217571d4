"""The table `str(report)` prints of a `MemoryReport`: the footprints, the
capacities with their verdicts and advice, what is held where, the traffic and the
step time. A report is read by its fields (this module imports nothing of its type,
which calls it).
"""

import functools
import textwrap
from collections import defaultdict
from typing import Any

from . import _step_time, _traffic
from ._targets import PINNED_CAP
from ._units import device_word, header, host_total, row, size_text


PARTS = ("argument", "output", "temp", "alias")
_WAYS = ("host_to_device", "device_to_host")
UNNAMED = ("(other)", "(unnamed, in stacked layers)")
DESCRIPTIONS = {
    "train_step": "a train step",
    "filter_offload": "the gradient of a filter_offload function",
    "function": "a function",
}


def lines(r: Any) -> list[str]:
    """The table `str(report)` prints, of a `MemoryReport` `r`."""
    lines = _title(r) + _footprint(r) + _capacities(r) + _held(r)
    traffic = ((r.transfers, "as traced"), (r.compiled_transfers, "as compiled"))
    for rows, how in traffic:
        lines += _traffic.table_lines(rows, how) if rows else []
    if r.compiled == "train_step" and (moved := r.compiled_transfers or r.transfers):
        h2d, d2h = (sum(t.bytes for t in moved if t.direction == d) for d in _WAYS)
        lines.append(row("  total", h2d, d2h))
    if r.time is not None:
        lines += _step_time.lines(r.time)
    return lines


def _title(r: Any) -> list[str]:
    """What was compiled for what, and the table's header."""
    what = DESCRIPTIONS[r.compiled]
    if r.estimate:
        lines = [
            f"Memory report for {what}, compiled for this CPU backend",
            "(an estimate: XLA's CPU compiler has one memory, so the split follows "
            "the leaves' memory kinds",
            "and temporaries count as device memory)",
        ]
    elif r.chips is not None and r.chips > 1:
        hosts = r.chips // (r.chips_per_host or r.chips)
        lines = [
            f"Memory report for {what}, compiled for {r.target}: "
            f"{r.chips} {device_word(r.target)}s, {r.chips_per_host} per host "
            f"({hosts} host{'s' if hosts > 1 else ''})"
        ]
    else:
        lines = [f"Memory report for {what}, compiled for {r.target}"]
    per_chip = f"per {device_word(r.target)}" if r.chips is not None else ""
    return lines + header(per_chip, "device", "host")


def _footprint(r: Any) -> list[str]:
    """The footprints and their parts."""
    lines = [row("footprint", r.device_bytes, r.host_bytes)]
    for part, label in zip(PARTS, ("arguments", "outputs", "temporaries")):
        lines.append(row(f"  {label}", r.device[part], r.host[part]))
    if r.host_compute_temp:
        lines.append(row("  host compute temporaries", None, r.host_compute_temp))
    label = "  aliased (donated, counted once)"
    return lines + [row(label, -r.device["alias"], -r.host["alias"])]


def _capacities(r: Any) -> list[str]:
    """The capacities of one device, whether the step fits them, and what would
    shrink the host's share if it does not; the host memory of a host."""
    lines = []
    if r.capacity is not None or r.host_capacity is not None:
        label = f"capacity of one {device_word(r.target)}"
        pinned = r.host_limit == "pinned host cap"
        note = "  host: JAX's pinned host cap" if pinned else ""
        lines.append(row(label, r.capacity, r.host_capacity) + note)
        lines.append(row("  verdict", _VERDICTS[r.fits_device], _VERDICTS[r.fits_host]))
    if r.fits_host is False and r.host_limit == "pinned host cap":
        gib = -(-r.host_bytes_per_host // 2**30)  # (a process's, rounded up)
        lines.append(f"  raise the cap: set {PINNED_CAP}={gib} before JAX starts")
    if r.fits_host is False:
        lines.append("  the host memory is exceeded; to shrink it:")
        room = r.fits_device is True  # (to keep some of it there)
        found = host_advice(
            r.target, r.opt_state, r.residuals, r.host_capacity or 0, room
        )
        lines += [line for advice in found for line in _wrap(advice)]
    if r.chips is not None and r.chips > 1:
        label = f"host memory of a host ({r.chips_per_host} {device_word(r.target)}s)"
        lines.append(row(label, None, r.host_bytes_per_host))
    return lines


_wrap = functools.partial(
    textwrap.wrap,
    width=80,
    initial_indent="    - ",
    subsequent_indent="      ",
    break_on_hyphens=False,
)


def _held(r: Any) -> list[str]:
    """Parameters, optimizer state and residuals, or the arguments, by memory."""
    held = {"parameters": r.params, "optimizer state": r.opt_state}
    lines = [_by_kind(label, by) for label, by in held.items() if by is not None]
    if r.residuals is not None:
        lines += _residual_lines(r)
    if r.params is None:
        lines.append("arguments")
        lines += [_by_kind(f"  {name}", by) for name, by in r.arguments.items()]
    return lines


def _by_kind(label: str, by_kind: dict[str, int]) -> str:
    return row(label, by_kind.get("device", 0), host_total(by_kind))


def _residual_lines(r: Any) -> list[str]:
    """What is saved for the backward pass, by name, with the largest unnamed."""
    whole = ", whole arrays" if r.chips is not None and r.chips > 1 else ""
    lines = [f"saved for the backward pass (as traced{whole})"]
    totals: dict[str, dict[str, int]] = defaultdict(dict)
    for saved in r.residuals or ():
        totals[saved.name][saved.memory_kind] = saved.bytes
    for name, by_kind in totals.items():
        lines.append(_by_kind(f"  {name}", by_kind))
        lines += _unnamed_lines(r.largest_unnamed or (), name)
    if not totals:
        lines.append("  (nothing)")
    hints = [line for group in UNNAMED if group in totals for line in _HINTS[group]]
    return lines + hints


_VERDICTS = {None: "", True: "fits", False: "does NOT fit"}


def host_advice(
    target: str,
    opt_state: dict[str, int] | None,
    residuals: tuple[Any, ...] | None,
    host_capacity: int,
    device_room: bool,
) -> list[str]:
    """What would shrink the host memory of one device of `target`, for a step
    that exceeds it: never more offloading, which only adds to it; keeping some of
    it on the device only when the device has room (`device_room`)."""
    u, chip = device_word(target), target.split(":")[0]
    least = max(int(host_capacity * 0.01), 1)
    example = "a larger one" if ":" in target else f"such as {_larger(chip)!r}"
    advice = [
        f"more {u}s: FSDP over a slice splits the parameters and optimizer state "
        f"between them (`Policy(shard='fsdp', batch='fsdp')` on a target "
        f"{example}; `eo.fewest_chips(..., chip={chip!r})` finds the fewest)"
    ]
    if host_total(opt_state or {}) >= least:
        advice.append(
            "Adam's first moment in bfloat16: `optax.adamw(..., "
            "mu_dtype=jnp.bfloat16)` halves its bytes"
        )
    offloaded = sum(r.bytes for r in residuals or () if r.memory_kind != "device")
    if offloaded >= least:
        advice.append(
            f"fewer offloaded activations ({size_text(offloaded)} on the host): a "
            "smaller batch, or recompute names instead of offloading them "
            "(`Policy(offload=...)`)"
        )
    if device_room:
        advice.append(
            "keep part of it on the device, which has room: "
            f"`eo.plan(..., target={target!r})` chooses within both memories"
        )
    advice.append("a smaller model")
    return advice


def _larger(chip: str) -> str:
    """A target of several devices of `chip`, for an example."""
    if chip.startswith("gpu-"):
        return f"{chip}:8"
    return f"{chip}:2x2x1" if chip in ("tpu-v5p", "tpu-v4") else f"{chip}:2x2"


def _unnamed_lines(largest: tuple[Any, ...], group: str) -> list[str]:
    """Under an unnamed group's row: the lines of code that save the most in it."""
    lines = []
    for r in [u for u in largest if u.group == group]:
        value = f"{r.dtype}[{','.join(map(str, r.shape))}]"
        what = f"    {value}" if r.count == 1 else f"    {r.count} values, {value}"
        device, host = (r.bytes, 0) if r.memory_kind == "device" else (0, r.bytes)
        lines.append(row(what, device, host))
        if r.where is None and r.operations == ("device_put",):
            lines.append("      host-resident leaves, on the device for the step")
        elif r.where is None and r.operations == ("convert_element_type",):
            lines.append("      device-resident parameters in the compute dtype")
        else:
            where = r.where or "(no line of yours)"
            shown = r.operations[:4] + (("...",) if len(r.operations) > 4 else ())
            lines.append(f"      {where}: {', '.join(shown)}")
    return lines


# How to shrink each unnamed group the table shows.
_HINTS = {
    "(other)": [
        "  (other) is saved outside every `Stacked`, where no policy applies:",
        "    hold repeated layers in an `eo.Stacked` (a Python list of them is",
        "    on the device whole), recompute other code (`eqx.filter_checkpoint`",
        "    around it), or for logits use `eo.chunked_cross_entropy`",
    ],
    "(unnamed, in stacked layers)": [
        "  (unnamed, in stacked layers): name a value inside the layer",
        "    (`jax.ad_checkpoint.checkpoint_name(x, 'h')`), then save or offload",
        "    it by name (`Policy(offload=('blocks.h',))`), or recompute it",
    ],
}
