"""`MemoryReport` and its rows: where a step's bytes live.

They are figures, and the table `str(report)` prints. `memory_report` in
`_memory_report.py` builds it.
"""

import dataclasses
import functools
import textwrap
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, NoReturn

from .._errors import see
from . import _minimum, _plot, _step_time, _traffic
from ._step_time import StepTime
from ._traffic import Transfer
from ._units import device_word, size_text


PARTS = ("argument", "output", "temp", "alias")
DESCRIPTIONS = {
    "train_step": "a train step",
    "filter_offload": "the gradient of a filter_offload function",
    "function": "a function",
}


class ResidualRow(NamedTuple):
    """Bytes saved for the backward pass under one checkpoint name and memory kind."""

    name: str  # a checkpoint name, or "(unnamed, in stacked layers)", "(other)"
    memory_kind: str
    bytes: int


class UnnamedResidual(NamedTuple):
    """Values saved for the backward pass without a checkpoint name. They are computed
    on one line of your code. Each is one of the largest parts of a `"(other)"` row of
    `MemoryReport.residuals` (outside every `Stacked`). Or of its `"(unnamed, in stacked
    layers)"` row."""

    group: str  # "(other)" or "(unnamed, in stacked layers)"
    memory_kind: str
    where: str | None  # `file.py:80 (loss_fn) > softmax_cross_entropy`, if known
    operations: tuple[str, ...]  # what computed them (`exp`, `mul`, ...)
    count: int  # how many values
    shape: tuple[int, ...]  # of the largest (over all layers, in stacked layers)
    dtype: str  # of the largest
    bytes: int  # of all of them


UNNAMED = ("(other)", "(unnamed, in stacked layers)")
LARGEST = 3  # unnamed residuals shown per group

_KIND_IS_COMPILED = (
    "`MemoryReport.kind` is now `MemoryReport.compiled`. Read `report.compiled`."
    + see(144)
)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Where the memory of one compiled step lives. Print it for a table.

    Every byte count is **per device** (per TPU chip or GPU). The step is one SPMD
    program, and each device runs it on its own shards.

    - `compiled`: what was compiled: `"train_step"`, `"filter_offload"` (its gradient)
        or `"function"`.
    - `device_bytes`, `host_bytes`: the footprints of one chip, `argument + output +
        temp - alias` of each memory. `device` and `host` hold the parts as the compiler
        counts them. Each array counts as one chip's shard, padded to the compiler's
        tiles. A replicated array counts whole.
    - `chips`, `chips_per_host`: the devices compiled for, and how many one host serves.
        E.g. 1 for `"tpu-v5e"`, 16 for `"tpu-v5e:4x4"`, 32 GPUs for `"gpu-h100:4x8"`. A
        host serves 4 chips for v5e, v6e and v5p; 8 TensorCores for v4; the target's
        GPUs per host. `None` on this backend.
    - `host_bytes_per_host`: `host_bytes * chips_per_host`, the host memory of one host.
        (Each chip's host-resident shards are its own buffers.)
    - `params`, `opt_state`: bytes by memory kind between steps (`None` for a plain
        function). On a TPU, the unpadded bytes of one chip's shards.
    - `residuals`: bytes saved for the backward pass by checkpoint name and memory kind,
        as traced. `None` for a plain function. Whole arrays, summed over the chips of a
        slice, in the dtype they are saved in. A `train_step`'s come from its loss on
        one micro-batch, with the `compute_dtype` copies. The compiler may still place a
        small residual elsewhere.
    - `largest_unnamed`: the largest values saved without a checkpoint name. Up to three
        `eo.UnnamedResidual` rows per group, each with its shape, dtype, operations and
        line of code.
    - `capacity`, `fits_device`: the device memory a program may use on one chip, and
        whether `device_bytes` fits in it. A v5e gives 15.75 GiB of its 16. A GPU gives
        the share JAX's allocator takes (75% by default). `None` on this backend.
    - `host_capacity`, `fits_host`: the host memory behind one chip, and whether
        `host_bytes` fits in it (`Hardware.host_memory_bytes`: 48 GB for a v5e chip).
        `None` on this backend. Every chip of a host runs the same program: this is the
        host's verdict too.
    - `fits`: both: `False` if either is exceeded, `None` if one is unknown.
    - `arguments`: bytes of each argument by memory kind (per chip on a TPU).
    - `estimate`: `True` on the CPU backend, whose compiler has one memory. The split
        follows the leaves' kinds; temporaries count as device's.
    - `transfers`: bytes moved host <-> device per step, as the traced program asks.
        They are `eo.Transfer` rows by direction, phase, what and name.
    - `compiled_transfers`: the same, read from the compiled program of a TPU or GPU
        target (else `None`). The compiler drops moves of values nothing uses. A
        computed value that no named scope describes is `"computed"`.
    - `time`: the estimated step time (an `eo.StepTime`); `None` on the CPU.
    - `host_to_device_bytes`, `device_to_host_bytes`: the totals per step. They come
        from `compiled_transfers` where there are some, else from `transfers`.
        `transfer_bytes(direction, *, phase, what, compiled)` gives a part.
    - `minimum_transfers`: the fewest bytes a `train_step` must move per step. A
        `MinimumTraffic`, residuals apart; `None` for other functions.
    - `host_compute_temp`: the host memory host compute takes while it runs
        (`compute_on("device_host")`, `Policy(update="host")`). That is one array of its
        largest shape. `host_bytes` counts it; the compiler's `host["temp"]` does not. 0
        without host compute.
    """

    target: str
    compiled: str  # "train_step", "filter_offload" or "function"
    estimate: bool
    capacity: int | None  # device memory of one chip of the target, if known
    device: dict[str, int]
    host: dict[str, int]
    arguments: dict[str, dict[str, int]]
    params: dict[str, int] | None = None
    opt_state: dict[str, int] | None = None
    residuals: tuple[ResidualRow, ...] | None = None
    largest_unnamed: tuple[UnnamedResidual, ...] | None = None
    chips: int | None = None  # devices compiled for (TPU and GPU targets)
    chips_per_host: int | None = None  # of them, how many one host serves
    host_capacity: int | None = None  # host memory behind one chip, if known
    transfers: tuple[Transfer, ...] | None = None
    compiled_transfers: tuple[Transfer, ...] | None = None
    time: StepTime | None = None
    host_compute_temp: int = 0  # host computations' own temporaries, estimated
    minimum_transfers: _minimum.MinimumTraffic | None = None  # the fewest moves

    @property
    def kind(self) -> NoReturn:
        """Of earlier versions; now `compiled` (reading it raises an error)."""
        raise AttributeError(_KIND_IS_COMPILED)

    @property
    def host_to_device_bytes(self) -> int:
        """Bytes moved from host to device memory per step. They come from
        `compiled_transfers` on a TPU or GPU target, else from `transfers`."""
        return self.transfer_bytes("host_to_device", compiled=self._from_compiled)

    @property
    def device_to_host_bytes(self) -> int:
        """Bytes moved from device to host memory per step, as
        `host_to_device_bytes`."""
        return self.transfer_bytes("device_to_host", compiled=self._from_compiled)

    @property
    def _from_compiled(self) -> bool:
        return self.compiled_transfers is not None

    def transfer_bytes(
        self,
        direction: Literal["host_to_device", "device_to_host"],
        *,
        phase: Literal["forward/backward", "update"] | None = None,
        what: str | None = None,
        compiled: bool = False,
    ) -> int:
        """The bytes moved per step in one direction, from `transfers`. `phase` and
        `what` select a part. `what` is `"params"`, `"opt_state"`, `"gradients"`,
        `"residuals"`, `"batch"` or `"other"`. Compiled transfers also have
        `"computed"`. `compiled=True` reads `compiled_transfers` instead (a TPU or GPU
        target's report has them)."""
        rows = self.compiled_transfers if compiled else self.transfers
        if compiled and rows is None:
            raise ValueError(
                "`MemoryReport.transfer_bytes(compiled=True)`: no compiled transfers. "
                "Report with a `target=`."
            )
        return sum(
            t.bytes
            for t in rows or ()
            if t.direction == direction
            and (phase is None or t.phase == phase)
            and (what is None or t.what == what)
        )

    def transfer_seconds(
        self,
        direction: Literal["host_to_device", "device_to_host"],
        *,
        phase: Literal["forward/backward", "update"] | None = None,
        what: str | None = None,
    ) -> float:
        """The host-link time of part of the compiled transfers. That is
        `transfer_bytes(..., compiled=True)` at the link's rate in `time`. E.g.
        `transfer_seconds("host_to_device", what="params")`."""
        if self.time is None:
            raise ValueError(
                "`MemoryReport.transfer_seconds`: this report has no step time. "
                "Report with a `target=`." + see(112)
            )
        hw = self.time.hardware
        rate = (
            hw.host_to_device_bytes_per_second
            if direction == "host_to_device"
            else hw.device_to_host_bytes_per_second
        )
        moved = self.transfer_bytes(direction, phase=phase, what=what, compiled=True)
        return moved / rate

    @property
    def device_bytes(self) -> int:
        d = self.device
        return d["argument"] + d["output"] + d["temp"] - d["alias"]

    @property
    def fits_device(self) -> bool | None:
        """Whether `device_bytes` is within `capacity`. `None` if the target's capacity
        is not known, as on the CPU."""
        return None if self.capacity is None else self.device_bytes <= self.capacity

    @property
    def fits_host(self) -> bool | None:
        """Whether `host_bytes` is within `host_capacity`, the host memory behind one
        chip. `None` if it is not known, as on the CPU."""
        if self.host_capacity is None:
            return None
        return self.host_bytes <= self.host_capacity

    @property
    def fits(self) -> bool | None:
        """Whether the step fits both memories of one chip. `False` if it exceeds either
        (`fits_device`, `fits_host`), `None` if one is not known."""
        if self.fits_device is False or self.fits_host is False:
            return False
        if self.fits_device is None or self.fits_host is None:
            return None
        return True

    @property
    def host_bytes(self) -> int:
        h = self.host
        compiled = h["argument"] + h["output"] + h["temp"] - h["alias"]
        return compiled + self.host_compute_temp

    @property
    def host_bytes_per_host(self) -> int:
        """The host memory of one host: `host_bytes` of each of the `chips_per_host`
        chips it serves. On this backend it is `host_bytes`: the whole program runs on
        this machine."""
        return self.host_bytes * (self.chips_per_host or 1)

    @property
    def _unit(self) -> str:
        return device_word(self.target)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data (bytes as ints)."""
        return {
            "target": self.target,
            "compiled": self.compiled,
            "estimate": self.estimate,
            "capacity": self.capacity,
            "host_capacity": self.host_capacity,
            "fits": self.fits,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "device": dict(self.device),
            "host": dict(self.host),
            "arguments": {k: dict(v) for k, v in self.arguments.items()},
            "params": None if self.params is None else dict(self.params),
            "opt_state": None if self.opt_state is None else dict(self.opt_state),
            "residuals": _as_dicts(self.residuals),
            "largest_unnamed": None
            if self.largest_unnamed is None
            else [r._asdict() | {"shape": list(r.shape)} for r in self.largest_unnamed],
            "chips": self.chips,
            "chips_per_host": self.chips_per_host,
            "host_bytes_per_host": self.host_bytes_per_host,
            "host_to_device_bytes": self.host_to_device_bytes,
            "device_to_host_bytes": self.device_to_host_bytes,
            "transfers": _as_dicts(self.transfers),
            "compiled_transfers": _as_dicts(self.compiled_transfers),
            "time": None if self.time is None else self.time.to_dict(),
            "host_compute_temp": self.host_compute_temp,
            "minimum_transfers": _minimum.to_dict(self.minimum_transfers),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MemoryReport":
        """The report `to_dict()` gave (read back from JSON, say). Its derived figures
        (`device_bytes`, `fits`, ...) are computed again."""
        if "compiled" not in data and "kind" in data:  # saved before the rename
            data = {**data, "compiled": data["kind"]}
        missing = {"target", "compiled", "estimate", "device", "host"} - set(data)
        if missing:
            raise ValueError(
                f"`MemoryReport.from_dict(data)`: `data` lacks "
                f"{', '.join(sorted(missing))}. Pass what `to_dict()` returns."
            )

        def rows(key: str, row: Callable[..., Any]) -> Any:
            value = data.get(key)
            return None if value is None else tuple(row(**r) for r in value)

        return cls(
            target=data["target"],
            compiled=data["compiled"],
            estimate=data["estimate"],
            capacity=data.get("capacity"),
            device=dict(data["device"]),
            host=dict(data["host"]),
            arguments={k: dict(v) for k, v in data.get("arguments", {}).items()},
            params=data.get("params"),
            opt_state=data.get("opt_state"),
            residuals=rows("residuals", ResidualRow),
            largest_unnamed=rows("largest_unnamed", _unnamed_row),
            chips=data.get("chips"),
            chips_per_host=data.get("chips_per_host"),
            host_capacity=data.get("host_capacity"),
            transfers=rows("transfers", Transfer),
            compiled_transfers=rows("compiled_transfers", Transfer),
            time=None if data.get("time") is None else StepTime.from_dict(data["time"]),
            host_compute_temp=data.get("host_compute_temp", 0),
            minimum_transfers=_minimum.from_dict(data.get("minimum_transfers")),
        )

    def plot(
        self,
        *others: "MemoryReport",
        labels: Sequence[str] | None = None,
        ax: Any = None,
        unit: Literal["GiB", "MiB", "KiB", "B"] | None = None,
        title: str | None = None,
    ) -> Any:
        """Draws where the memory lives, for this report and each of `others`.

        Each report gets a stacked bar for the device and one for the host (per
        chip). The parts: parameters, optimizer state, other arguments (the batch;
        on a TPU also tile padding), saved activations by checkpoint name (one
        chip's reports), other temporaries, host compute's (`host_compute_temp`),
        and outputs not written in place. Under each label: the estimated step
        time and its bound. A device bar within half of the capacity gets the
        capacity as a dashed line.

        Needs matplotlib (`pip install matplotlib`; from a clone, the `plot` extra).

        **Arguments:**

        - `*others`: more reports to draw next to this one (presets, depths, chip
            counts...).
        - `labels`: one label per report, this one first (default: the targets).
        - `ax`: a matplotlib `Axes` to draw on (default: a new figure).
        - `unit`: `"GiB"`, `"MiB"`, `"KiB"` or `"B"`; by default the largest in
            which the tallest bar is at least 1.
        - `title`: the axes' title.

        **Returns:**

        The matplotlib `Axes`; `ax.figure.savefig("memory.png")` saves it.
        """
        return _plot.plot((self, *others), labels, ax=ax, unit=unit, title=title)

    def __str__(self) -> str:
        lines = _title(self) + _footprint(self) + _capacities(self) + _held(self)
        traffic = (
            (self.transfers, "as traced"),
            (self.compiled_transfers, "as compiled"),
        )
        for rows, how in traffic:
            lines += _traffic.table_lines(rows, how) if rows else []
        lines += _minimum.table_lines(self)
        if self.time is not None:
            lines += _step_time.lines(self.time)
        return "\n".join(lines)


def _as_dicts(rows: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    return None if rows is None else [r._asdict() for r in rows]


def _row(label: str, device: int | None, host: int) -> str:
    shown = "" if device is None else size_text(device)
    return f"{label:<34}{shown:>14}{size_text(host):>14}"


def _title(r: MemoryReport) -> list[str]:
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
            f"{r.chips} {r._unit}s, {r.chips_per_host} per host "
            f"({hosts} host{'s' if hosts > 1 else ''})"
        ]
    else:
        lines = [f"Memory report for {what}, compiled for {r.target}"]
    per_chip = f"per {r._unit}" if r.chips is not None else ""
    header = f"{per_chip:<34}{'device':>14}{'host':>14}"
    return lines + [header, "-" * len(header)]


def _footprint(r: MemoryReport) -> list[str]:
    """The footprints and their parts."""
    lines = [_row("footprint", r.device_bytes, r.host_bytes)]
    for part, label in zip(PARTS, ("arguments", "outputs", "temporaries")):
        lines.append(_row(f"  {label}", r.device[part], r.host[part]))
    if r.host_compute_temp:
        lines.append(_row("  host compute temporaries", None, r.host_compute_temp))
    label = "  aliased (donated, counted once)"
    return lines + [_row(label, -r.device["alias"], -r.host["alias"])]


def _capacities(r: MemoryReport) -> list[str]:
    """The capacities of one device, whether the step fits them, and what would
    shrink the host's share if it does not; the host memory of a host."""
    lines = []
    if r.capacity is not None or r.host_capacity is not None:
        lines.append(
            f"{f'capacity of one {r._unit}':<34}"
            f"{_size_or_blank(r.capacity):>14}{_size_or_blank(r.host_capacity):>14}"
        )
        lines.append(
            f"{'  verdict':<34}{_verdict(r.fits_device):>14}{_verdict(r.fits_host):>14}"
        )
    if r.fits_host is False:
        lines.append("  the host memory is exceeded; to shrink it:")
        for advice in host_advice(
            r.target,
            r.opt_state,
            r.residuals,
            r.host_capacity or 0,
            device_room=r.fits_device is True,
        ):
            lines += _wrap(advice)
    if r.chips is not None and r.chips > 1:
        label = f"host memory of a host ({r.chips_per_host} {r._unit}s)"
        lines.append(_row(label, None, r.host_bytes_per_host))
    return lines


_wrap = functools.partial(
    textwrap.wrap,
    width=80,
    initial_indent="    - ",
    subsequent_indent="      ",
    break_on_hyphens=False,
)


def _held(r: MemoryReport) -> list[str]:
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
    return _row(label, by_kind.get("device", 0), host_total(by_kind))


def _residual_lines(r: MemoryReport) -> list[str]:
    """What is saved for the backward pass, by name, with the largest unnamed."""
    whole = ", whole arrays" if r.chips is not None and r.chips > 1 else ""
    lines = [f"saved for the backward pass (as traced{whole})"]
    totals: dict[str, dict[str, int]] = defaultdict(dict)
    for row in r.residuals or ():
        totals[row.name][row.memory_kind] = row.bytes
    for name, by_kind in totals.items():
        lines.append(_by_kind(f"  {name}", by_kind))
        lines += _unnamed_lines(r.largest_unnamed or (), name)
    if not totals:
        lines.append("  (nothing)")
    return lines + _unnamed_hints({name for name in totals if name in UNNAMED})


def _size_or_blank(n: int | None) -> str:
    return "" if n is None else size_text(n)


def _verdict(fits: bool | None) -> str:
    return {None: "", True: "fits", False: "does NOT fit"}[fits]


def host_advice(
    target: str,
    opt_state: dict[str, int] | None,
    residuals: tuple[ResidualRow, ...] | None,
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


def _unnamed_row(**fields: Any) -> UnnamedResidual:
    """An `UnnamedResidual` from JSON (lists for tuples)."""
    fields = dict(fields)
    fields["shape"] = tuple(fields["shape"])
    fields["operations"] = tuple(fields["operations"])
    return UnnamedResidual(**fields)


def _unnamed_lines(largest: tuple[UnnamedResidual, ...], group: str) -> list[str]:
    """Under an unnamed group's row: the lines of code that save the most in it."""
    lines = []
    for r in largest:
        if r.group != group:
            continue
        value = f"{r.dtype}[{','.join(map(str, r.shape))}]"
        what = f"    {value}" if r.count == 1 else f"    {r.count} values, {value}"
        device, host = (r.bytes, 0) if r.memory_kind == "device" else (0, r.bytes)
        lines.append(f"{what:<34}{size_text(device):>14}{size_text(host):>14}")
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


def _unnamed_hints(groups: set[str]) -> list[str]:
    return [line for group in UNNAMED if group in groups for line in _HINTS[group]]


def host_total(by_kind: dict[str, int]) -> int:
    return sum(v for k, v in by_kind.items() if k != "device")
