"""`DoesNotFit`: the error `memory_report` raises for a program too big for one
device of its target, with what is known of it as data, and what to change."""

import functools
from typing import Any, Literal

from .. import _compiler, _paths
from .._policy import Policy
from ._memory_report_type import (
    device_word,
    host_advice,
    host_total,
    ResidualRow,
    size_text,
    UNNAMED,
)


Memory = Literal["device", "host"]


class DoesNotFit(ValueError):
    """Raised by `memory_report` when the compiler finds the program too big for the
    target's memory. The message gives the compiler's numbers and what is known
    without compiling; so do the attributes:

    - `target`: what it was compiled for (`"tpu-v5e"`, ...).
    - `exceeded`: the memories the step is too big for, `("device",)`,
        `("device", "host")` or, from `eo.plan` and `eo.fewest_chips`,
        `("host",)`. `memory_report` raises only for the device: a step that
        compiles and exceeds only the host's memory is a report with `fits_host`
        `False`.
    - `required_bytes`, `available_bytes`: the compiler's figures (`None` if its
        message had none); on a GPU, the footprint and the allocator's share.
    - `host_required_bytes`, `host_available_bytes`: host memory per device: what
        the step needs (where the compile failed, at least its host-resident
        arguments) and what one device of the target has
        (`MemoryReport.host_capacity`); `None` where not known.
    - `params`, `opt_state`: bytes of parameters and optimizer state by memory kind
        (`train_step` and `filter_offload` objects; `None` otherwise).
    - `residuals`: bytes saved for the backward pass by checkpoint name and memory
        kind, as traced (`None` when not a `train_step`/`filter_offload`).
    - `arguments`: bytes of each argument by memory kind.
    - `compiler_message`: the compiler's own words.
    - `tried`: raised by `eo.plan`, every candidate it considered (a `PlanTable`:
        `print(e.tried)`); `None` otherwise.
    """

    target: str
    exceeded: tuple[Memory, ...]
    required_bytes: int | None
    available_bytes: int | None
    host_required_bytes: int | None
    host_available_bytes: int | None
    params: dict[str, int] | None
    opt_state: dict[str, int] | None
    residuals: tuple[ResidualRow, ...] | None
    arguments: dict[str, dict[str, int]]
    compiler_message: str
    tried: Any

    def __init__(
        self,
        message: str,
        *,
        target: str,
        compiler_message: str,
        arguments: dict[str, dict[str, int]],
        params: dict[str, int] | None = None,
        opt_state: dict[str, int] | None = None,
        residuals: tuple[ResidualRow, ...] | None = None,
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
        self.arguments = arguments
        self.params = params
        self.opt_state = opt_state
        self.residuals = residuals
        self.tried = None

    def __reduce__(self) -> tuple:
        """Pickled whole, figures and all (`plan` receives it from a child process)."""
        rebuild = functools.partial(
            type(self),
            target=self.target,
            compiler_message=self.compiler_message,
            arguments=self.arguments,
            params=self.params,
            opt_state=self.opt_state,
            residuals=self.residuals,
            sizes=(self.required_bytes, self.available_bytes),
            host_sizes=(self.host_required_bytes, self.host_available_bytes),
            exceeded=self.exceeded,
        )
        return rebuild, (str(self),), {"tried": self.tried}


def too_big(
    message: str,
    *,
    what: str,
    one_device: str,
    target: str,
    is_slice: bool,
    per_device: bool,
    kind: str,
    policy: Policy | None,
    params: dict[str, int] | None,
    opt_state: dict[str, int] | None,
    residuals: tuple[ResidualRow, ...] | None,
    arguments: dict[str, dict[str, int]],
    capacity: int | None,
    host_capacity: int | None,
    sizes: tuple[int, int] | None = None,
    host_bytes: int | None = None,
) -> DoesNotFit:
    """`memory_report`'s error for `what` (`"a train step"`), too big for the
    device memory of `one_device` (`"one tpu-v5e chip"`): what it holds, whether
    its host memory (`host_bytes`, or where the compile failed its host-resident
    arguments, a floor) exceeds `host_capacity` too, and what would shrink each
    memory it exceeds, never the placement of `policy`, the policy in use.
    `message` is the compiler's, or with `sizes` (required, available) our own."""
    said = "" if sizes is not None else "the compiler says: "
    u = device_word(target)
    lines = [
        f"`memory_report`: {what} does not fit in the device memory of "
        f"{one_device}; {said}{message.strip().rstrip('.')}.",
        "What it holds, by memory kind (device / host"
        + (f", per {u}" if per_device else "")
        + "):",
    ]

    def row(label: str, by_kind: dict[str, int]) -> None:
        device, host = by_kind.get("device", 0), host_total(by_kind)
        lines.append(f"  {label}: {size_text(device)} / {size_text(host)}")

    if params is not None and opt_state is not None:
        row("parameters", params)
        row("optimizer state", opt_state)
    else:
        for name, by_kind in arguments.items():
            row(f"argument {name}", by_kind)
    if residuals is not None:
        saved: dict[str, int] = {}
        for r in residuals:
            saved[r.memory_kind] = saved.get(r.memory_kind, 0) + r.bytes
        label = "saved for the backward pass"
        row(label + (" (whole arrays)" if is_slice else ""), saved)
    on_host = sum(host_total(by_kind) for by_kind in arguments.values())
    host_need = on_host if host_bytes is None else host_bytes
    host_full = host_capacity is not None and host_need > host_capacity
    if host_capacity is not None and host_need:
        needs = (
            f"its host-resident arguments alone take {size_text(on_host)}"
            if host_bytes is None
            else f"its host footprint is {size_text(host_bytes)}"
        )
        lines.append(
            f"Host memory: {needs} per {u}, {'over' if host_full else 'within'} "
            f"the {size_text(host_capacity)} behind one {u} "
            "(`Hardware.host_memory_bytes`)"
            + (": both memories are exceeded." if host_full else ".")
        )
    advice = device_advice(
        target=target,
        is_slice=is_slice,
        kind=kind,
        policy=policy,
        params=params,
        opt_state=opt_state,
        residuals=residuals,
        capacity=capacity,
        host_full=host_full,
    )
    lines += ["To shrink the device memory:"] + [f"  - {a}" for a in advice]
    if host_full:
        assert host_capacity is not None
        advice = host_advice(
            target, opt_state, residuals, host_capacity, device_room=False
        )
        lines += ["To shrink the host memory:"] + [f"  - {a}" for a in advice]
    lines.append(
        "The numbers are on the exception (`e.params`, `e.residuals`, "
        "`e.host_required_bytes`, ...)."
    )
    return DoesNotFit(
        "\n".join(lines),
        target=target,
        compiler_message=message,
        arguments=arguments,
        params=params,
        opt_state=opt_state,
        residuals=residuals,
        sizes=sizes,
        host_sizes=(None if host_capacity is None else host_need, host_capacity),
        exceeded=("device", "host") if host_full else ("device",),
    )


# A part of the step is worth moving (or naming) when it holds at least this share
# of the memory it is in: a scalar counter on the device is not.
WORTH = 0.01


def device_advice(
    *,
    target: str,
    is_slice: bool,
    kind: str,
    policy: Policy | None,
    params: dict[str, int] | None,
    opt_state: dict[str, int] | None,
    residuals: tuple[ResidualRow, ...] | None,
    capacity: int | None,
    host_full: bool,
) -> list[str]:
    """What would shrink the device memory of a step too big for one device of
    `target` under `policy` (a `Policy`, or `None` for a plain function), given
    what it holds: only the moves that change something (a part still on the
    device, a preset other than `policy`), and no move to the host when the
    host's memory is exceeded too (`host_full`)."""
    least = max(int((capacity or 2**30) * WORTH), 1)
    on_device = {
        "params": (params or {}).get("device", 0),
        "opt_state": (opt_state or {}).get("device", 0),
    }
    saved: dict[str, int] = {}
    for r in residuals or ():
        if r.memory_kind == "device":
            saved[r.name] = saved.get(r.name, 0) + r.bytes
    advice = []
    if not host_full:
        if on_device["params"] >= least:
            advice.append(
                f"parameters on the host ({size_text(on_device['params'])} on the "
                "device): `Policy(params='pinned_host')`"
            )
        if on_device["opt_state"] >= least:
            advice.append(
                f"optimizer state on the host ({size_text(on_device['opt_state'])} "
                "on the device): `Policy(opt_state='pinned_host')`"
            )
    stacked = saved.get(UNNAMED[1], 0)
    recomputes = policy is not None and policy.save == "all"
    if recomputes and stacked >= least:
        offload = (
            ""
            if host_full
            else ", and offload each layer's input (`offload=('**.input',)`)"
        )
        advice.append(
            f"recompute each layer in the backward pass ({size_text(stacked)} saved "
            f"in the layers): `Policy(save=())`{offload}"
        )
    elif stacked >= least:
        advice.append(
            f"of what the layers save unnamed ({size_text(stacked)}), name a value "
            "inside the layer (`checkpoint_name(x, 'h')`) and offload or recompute "
            "it by name"
        )
    named = {n: b for n, b in saved.items() if n not in UNNAMED and b >= least}
    # A name the policy saves can be recomputed instead; the others are the carries
    # a scan keeps between layers, which only offloading moves.
    kept = [n for n in named if _saves(policy, n)]
    carries = [n for n in named if n not in kept]
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
    other = saved.get(UNNAMED[0], 0)
    if other >= least:
        advice.append(
            f"what is saved outside every `Stacked` ({size_text(other)}): for "
            "logits `eo.chunked_cross_entropy`, else `eqx.filter_checkpoint` around "
            "that code"
        )
    moves = ("params", "opt_state")
    if (
        not host_full
        and all(on_device[m] >= least for m in moves)
        and not _placed_as(policy, "offload_all")
    ):
        advice.append("all of these at once: `Policy.offload_all()`")
    if kind == "function" and not host_full:
        advice.append(
            "arguments in `pinned_host`, moved to the device by the function itself"
        )
    batch = "a smaller batch"
    if kind == "train_step":
        batch += ", or micro-batches (`eo.train_step(..., microbatches=4)`)"
    advice.append(batch)
    u = device_word(target)
    more = (
        f"more {u}s" if is_slice else f"more {u}s (a slice), or a {u} with more memory"
    )
    advice.append(more)
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
