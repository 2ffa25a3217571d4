"""`DoesNotFit`: the error for a program too big for one device of its target.

`memory_report` raises it. It carries what is known of the program as data, and
what to change.
"""

import functools
import math
from typing import Any, Literal, NamedTuple

import jax.tree_util as jtu

from .. import _compiler, _paths
from .._errors import see
from .._mixed_precision import ComputeCopyState
from .._policy import Policy
from ._memory_report_type import ResidualRow
from ._memory_table import DESCRIPTIONS, host_advice, UNNAMED
from ._targets import PINNED_CAP, Where
from ._units import device_word, host_total, one_device, size_text


Memory = Literal["device", "host"]


class Held(NamedTuple):
    """What a step holds, by memory kind: its arguments, parameters and optimizer
    state (`None` unless a `train_step`/`filter_offload`), and what it saves for the
    backward pass. Under `Policy(compute_dtype=...)`, the compute copies
    (`copies`), apart from the optimizer's own state (`opt_state`: `split_copies`).
    Of a `train_step`, `microbatches`: its micro-batches, and the most its batch
    allows (`microbatches_of`)."""

    arguments: dict[str, dict[str, int]]
    params: dict[str, int] | None = None
    opt_state: dict[str, int] | None = None
    residuals: tuple[ResidualRow, ...] | None = None
    copies: dict[str, int] | None = None
    microbatches: tuple[int, int] | None = None


def split_copies(opt_state: Any) -> tuple[Any, Any]:
    """The optimizer state without its compute copies (`ComputeCopyState`), and
    the copies (`None` where there are none)."""

    def is_copied(x: Any) -> bool:
        return isinstance(x, ComputeCopyState)

    found = [x for x in jtu.tree_leaves(opt_state, is_leaf=is_copied) if is_copied(x)]
    if not found:
        return opt_state, None
    inner = jtu.tree_map(
        lambda x: x.inner if is_copied(x) else x, opt_state, is_leaf=is_copied
    )
    return inner, [x.copies for x in found]


def microbatches_of(step: Any, batch: Any, devices: int) -> tuple[int, int] | None:
    """A train step's micro-batches and the most its batch allows over `devices`
    (the leading sizes' common divisor, over the devices); `None` for another
    function or a scalar batch."""
    sizes = [x.shape[0] for x in jtu.tree_leaves(batch) if getattr(x, "ndim", 0)]
    k = getattr(step, "microbatches", None)
    return None if k is None or not sizes else (k, math.gcd(*sizes) // devices)


class DoesNotFit(ValueError):
    """Raised when the compiler finds the program too big for the target's memory.

    `memory_report` raises it. The message gives the compiler's numbers. It also
    gives what is known without compiling. So do the attributes:

    - `target`: what it was compiled for (`"tpu-v5e"`, ...).
    - `exceeded`: the memories the step is too big for: `("device",)` or
        `("device", "host")`. From `eo.plan` and `eo.fewest_chips`, also
        `("host",)`. `memory_report` raises only for the device. A step that
        compiles and exceeds only the host's memory gives a report, with
        `fits_host` `False`.
    - `required_bytes`, `available_bytes`: the compiler's figures, or `None` if its
        message had none. On a GPU, the footprint and the allocator's share.
    - `host_required_bytes`, `host_available_bytes`: host memory per device. The
        first is what the step needs. Where the compile failed, it is at least the
        host-resident arguments. The second is what one device of the target has
        (`MemoryReport.host_capacity`). `None` where not known.
    - `params`, `opt_state`: bytes of parameters and optimizer state by memory kind.
        Known for `train_step` and `filter_offload` objects, else `None`.
    - `copies`: under `Policy(compute_dtype=...)`, bytes of the compute copies by
        memory kind (not counted in `opt_state`); else `None`.
    - `microbatches`: of a train step, its micro-batches and the most its batch
        allows; else `None`.
    - `residuals`: bytes saved for the backward pass by checkpoint name and memory
        kind, as traced. `None` when not a `train_step`/`filter_offload`.
    - `arguments`: bytes of each argument by memory kind.
    - `compiler_message`: the compiler's own words.
    - `tried`: every candidate `eo.plan` considered, when it raised this. It is a
        `PlanTable` (`print(e.tried)`). `None` otherwise.
    """

    tried: Any  # (assigned `None` below; a `PlanTable` where `plan` raises it)

    def __init__(
        self,
        message: str,
        *,
        target: str,
        compiler_message: str = "",
        arguments: dict[str, dict[str, int]] | None = None,
        params: dict[str, int] | None = None,
        opt_state: dict[str, int] | None = None,
        residuals: tuple[ResidualRow, ...] | None = None,
        copies: dict[str, int] | None = None,
        microbatches: tuple[int, int] | None = None,
        sizes: tuple[int | None, int | None] | None = None,
        host_sizes: tuple[int | None, int | None] = (None, None),
        exceeded: tuple[Memory, ...] = ("device",),
    ):
        super().__init__(message)
        self.target = target
        self.compiler_message = compiler_message
        found = sizes or _compiler.oom_sizes(compiler_message)
        self.required_bytes, self.available_bytes = found
        self.host_required_bytes, self.host_available_bytes = host_sizes
        self.exceeded = exceeded
        self.arguments = {} if arguments is None else arguments
        self.params = params
        self.opt_state = opt_state
        self.residuals = residuals
        self.copies = copies
        self.microbatches = microbatches
        self.tried = None

    def __reduce__(self) -> tuple:
        """Pickled whole, figures and all (`plan` receives it from a child process)."""
        made = functools.partial(type(self), target=self.target)
        return made, (str(self),), self.__dict__


def too_big(
    message: str,
    where: Where,
    compiled: str,
    policy: Policy | None,
    held: Held,
    host: tuple[int | None, str | None],
    sizes: tuple[int, int] | None = None,
    host_bytes: int | None = None,
) -> DoesNotFit:
    """`memory_report`'s error for what it `compiled` (`"train_step"`: "a train
    step"), too big for one device of what it compiles for (`where`: `"one tpu-v5e
    chip"`, `"one GPU of gpu-h100:8"` of a slice).

    The error says what the step holds (`held`). It says whether its host memory,
    `host_bytes`, exceeds `host` too: the host memory behind one device and what
    bounds it (`_targets.host_memory`), or `(None, None)`. Where the compile failed,
    `host_bytes` is the host-resident arguments (a floor). It advises what would
    shrink each memory it exceeds. It never advises the placement of `policy`, the
    policy in use. `message` is the compiler's. With `sizes` (required,
    available), it is our own.
    """
    host_capacity, limit = host
    said = "" if sizes is not None else "the compiler says: "
    target, is_slice = where.name, where.is_slice
    lines = [
        f"`memory_report`: {DESCRIPTIONS[compiled]} does not fit in the device "
        f"memory of {one_device(target, is_slice)}; {said}"
        f"{message.strip().rstrip('.')}.",
    ]
    lines += _holdings(held, where, (sizes or _compiler.oom_sizes(message))[0])
    on_host = sum(host_total(by_kind) for by_kind in held.arguments.values())
    host_need = on_host if host_bytes is None else host_bytes
    host_full = host_capacity is not None and host_need > host_capacity

    def host_line(capacity: int) -> str:
        """What the step needs there (its footprint, else its host-resident
        arguments) against the `capacity` one device has, and what bounds that
        (JAX's pinned host cap, which can be raised, or RAM)."""
        needs = (
            f"its host-resident arguments alone take {size_text(on_host)}"
            if host_bytes is None
            else f"its host footprint is {size_text(host_bytes)}"
        )
        bound = (
            f"(JAX's pinned host cap: raise it with {PINNED_CAP}=<GiB> set before "
            "JAX starts)"
            if limit == "pinned host cap"
            else "(`Hardware.host_memory_bytes`)"
        )
        u = device_word(target)
        return (
            f"Host memory: {needs} per {u}, {'over' if host_full else 'within'} "
            f"the {size_text(capacity)} behind one {u} {bound}"
            + (": both memories are exceeded." if host_full else ".")
        )

    if host_capacity is not None and host_need:
        lines.append(host_line(host_capacity))
    advice = device_advice(
        held, target, is_slice, compiled, policy, where.capacity, host_full
    )
    lines += ["To shrink the device memory:"] + [f"  - {a}" for a in advice]
    if host_full:
        assert host_capacity is not None
        advice = host_advice(
            target, held.opt_state, held.residuals, host_capacity, device_room=False
        )
        lines += ["To shrink the host memory:"] + [f"  - {a}" for a in advice]
    lines.append(
        "The numbers are on the exception (`e.params`, `e.residuals`, "
        "`e.host_required_bytes`, ...)." + see(124 if host_full else 53)
    )
    return DoesNotFit(
        "\n".join(lines),
        target=target,
        compiler_message=message,
        **held._asdict(),
        sizes=sizes,
        host_sizes=(None if host_capacity is None else host_need, host_capacity),
        exceeded=("device", "host") if host_full else ("device",),
    )


def _holdings(held: Held, where: Where, required: int | None) -> list[str]:
    """The rows of what a step holds: device / host bytes of each part; and of
    the `required` device bytes, the rest."""
    per = "" if where.mesh is None else f", per {device_word(where.name)}"
    if held.params is not None and held.opt_state is not None:
        rows = [("parameters", held.params), ("optimizer state", held.opt_state)]
    else:
        rows = [(f"argument {name}", by) for name, by in held.arguments.items()]
    if held.copies is not None:
        rows.append(("compute copies", held.copies))
    if held.residuals is not None:
        saved: dict[str, int] = {}
        for r in held.residuals:
            saved[r.memory_kind] = saved.get(r.memory_kind, 0) + r.bytes
        label = "saved for the backward pass"
        rows.append((label + (" (whole arrays)" if where.is_slice else ""), saved))
    lines = [f"What it holds, by memory kind (device / host{per}):"] + [
        f"  {label}: {size_text(by_kind.get('device', 0))} / "
        f"{size_text(host_total(by_kind))}"
        for label, by_kind in rows
    ]
    rest = (required or 0) - sum(by_kind.get("device", 0) for _, by_kind in rows)
    return lines + [
        "  the rest (the batch, gradients and their accumulators, temporaries): "
        f"{size_text(rest)} on the device"
    ] * (rest > 0)


# A part of the step is worth moving (or naming) when it holds at least this share
# of the memory it is in: a scalar counter on the device is not.
WORTH = 0.01


class _OnDevice(NamedTuple):
    """What a step too big for the device holds there: the bytes worth advice."""

    params: int
    opt_state: int  # without the compute copies
    copies: int
    saved: dict[str, int]  # residuals, by checkpoint name
    least: int  # the fewest bytes worth moving


def device_advice(
    held: Held,
    target: str,
    is_slice: bool,
    compiled: str,
    policy: Policy | None,
    capacity: int | None,
    host_full: bool,
) -> list[str]:
    """What would shrink the device memory of a step too big for one device.

    The step holds `held`. The device is one of `target`, of `capacity` bytes. The
    step runs under `policy` (`None` for a plain function).

    Only the moves that change something: a part still on the device, a preset
    other than `policy`. No move to the host when its memory is full too
    (`host_full`). Micro-batches only to a step in one whose batch splits.
    """
    saved: dict[str, int] = {}
    for r in held.residuals or ():
        if r.memory_kind == "device":
            saved[r.name] = saved.get(r.name, 0) + r.bytes
    on = _OnDevice(
        *[(by or {}).get("device", 0) for by in held[1:3] + (held.copies,)],
        saved=saved,
        least=max(int((capacity or 2**30) * WORTH), 1),
    )
    advice = [] if host_full else _to_the_host(on)
    advice += _residual_advice(on, policy, host_full)
    both = on.params >= on.least and on.opt_state >= on.least
    if not host_full and both and not _placed_as(policy, "offload_all"):
        advice.append("all of these at once: `Policy.offload_all()`")
    if compiled == "function" and not host_full:
        advice.append(
            "arguments in `pinned_host`, moved to the device by the function itself"
        )
    return advice + _smaller_or_more(target, is_slice, compiled, held.microbatches)


def _smaller_or_more(
    target: str, is_slice: bool, compiled: str, microbatches: tuple[int, int] | None
) -> list[str]:
    """The advice every step too big gets: a smaller batch (or micro-batches, to
    a train step in one whose batch splits: `microbatches`, its count and the
    most), more devices."""
    batch = "a smaller batch"
    k, most = microbatches or (1, 4)
    if compiled == "train_step" and k == 1 and most > 1:
        split = next(d for d in range(2, most + 1) if most % d == 0)
        batch += f", or micro-batches (`eo.train_step(..., microbatches={split})`)"
    u = device_word(target)
    more = f"more {u}s" + ("" if is_slice else f" (a slice), or a {u} with more memory")
    return [batch, more]


def _to_the_host(held: _OnDevice) -> list[str]:
    """Parameters, optimizer state and compute copies moved to the host, where
    worth it."""
    parts = (("parameters", "params"), ("optimizer state", "opt_state"))
    copies = (
        f"compute copies {size_text(held.copies)} on the device: put `copies:**` "
        "on the host (`Policy(opt_state={..., 'copies:**': 'pinned_host'})`), from "
        "where each micro-batch reads them"
    )
    return [
        f"{what} on the host ({size_text(getattr(held, field))} on the device): "
        f"`Policy({field}='pinned_host')`"
        for what, field in parts
        if getattr(held, field) >= held.least
    ] + [copies] * (held.copies >= held.least)


def _residual_advice(held: _OnDevice, policy: Any, host_full: bool) -> list[str]:
    """Residuals recomputed, named or offloaded, where worth it."""
    advice = []
    stacked = held.saved.get(UNNAMED[1], 0)
    if policy is not None and policy.save == "all" and stacked >= held.least:
        offload = ", and offload each layer's input (`offload=('**.input',)`)"
        offload = "" if host_full else offload
        advice.append(
            f"recompute each layer in the backward pass ({size_text(stacked)} saved "
            f"in the layers): `Policy(save=())`{offload}"
        )
    elif stacked >= held.least:
        advice.append(
            f"of what the layers save unnamed ({size_text(stacked)}), name a value "
            "inside the layer (`checkpoint_name(x, 'h')`) and offload or recompute "
            "it by name"
        )
    advice += _named_advice(held, policy, host_full)
    if (other := held.saved.get(UNNAMED[0], 0)) >= held.least:
        advice.append(
            f"what is saved outside every `Stacked` ({size_text(other)}): "
            "`eo.chunked_cross_entropy` for logits not yet chunked, else "
            "`eqx.filter_checkpoint` around that code"
        )
    return advice


def _named_advice(held: _OnDevice, policy: Any, host_full: bool) -> list[str]:
    """Named residuals on the device: recomputed if `save` keeps them.

    Others are offloaded. They are the carries a scan keeps between layers, which
    only offloading moves.
    """
    named = {
        n: b for n, b in held.saved.items() if n not in UNNAMED and b >= held.least
    }
    kept = [n for n in named if _saves(policy, n)]
    carries = [n for n in named if n not in kept]
    advice = []
    if kept:
        offload = "" if host_full else f", or offload them (`offload={tuple(kept)!r}`)"
        advice.append(
            f"the names `save` keeps on the device, {_sized(kept, named)}: recompute "
            f"them (drop them from `save`){offload}"
        )
    if carries and not host_full:
        advice.append(
            f"what the layers pass on, saved on the device, {_sized(carries, named)}: "
            f"offload it (`Policy(offload={tuple(carries)!r})`)"
        )
    return advice


def _sized(names: list[str], sizes: dict[str, int]) -> str:
    return ", ".join(f"{n!r} ({size_text(sizes[n])})" for n in names)


def _saves(policy: Any, name: str) -> bool:
    """Whether `policy`'s `save` names `name` (the carries no policy names)."""
    if policy is None or policy.save == "all":
        return False
    return any(_paths.matches(p, name) for p in policy.save)


def _placed_as(policy: Any, preset: str) -> bool:
    """Whether `policy` places parameters, residuals and optimizer state as the
    preset does (whatever its other settings)."""
    if policy is None:
        return False
    other = getattr(Policy, preset)()
    fields = ("params", "save", "offload", "offload_dst", "opt_state")
    return all(getattr(policy, f) == getattr(other, f) for f in fields)
