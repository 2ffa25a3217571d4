"""`MemoryReport` and its rows: where a step's bytes live, as figures and as the
table `str(report)` prints (`memory_report` in `_memory_report.py` builds it)."""

import textwrap
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx

from . import _minimum, _plot, _step_time, _traffic
from ._step_time import StepTime
from ._traffic import Transfer
from ._units import size_text


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
    """Values saved for the backward pass without a checkpoint name, computed on
    one line of your code: one of the largest parts of `MemoryReport.residuals`'
    `"(other)"` (outside every `Stacked`) or `"(unnamed, in stacked layers)"`
    rows."""

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


class MemoryReport(eqx.Module):
    """Where the memory of one compiled step lives. Print it for a table.

    Compiled for a TPU (one chip or a whole slice) or for GPUs (one, a node or
    several nodes), every byte count is **per chip** (per GPU): the step is one SPMD
    program, and each chip or GPU runs it on its own shards.

    - `device_bytes`, `host_bytes`: the footprints of one chip, `argument + output +
        temp - alias` of each memory (`device` and `host` hold the parts, as the
        compiler counts them: each array as the shard one chip holds, padded to the
        tiled layout the compiler chose; a replicated array whole).
    - `chips`, `chips_per_host`: the devices the step was compiled for (1 for
        `"tpu-v5e"`, 16 for `"tpu-v5e:4x4"`, 32 GPUs for `"gpu-h100:4x8"`) and how
        many of them one host serves (libtpu's layout of the slice: 4 for v5e, v6e
        and v5p; 8 TensorCores, four chips, for v4; for GPUs, the GPUs per host of
        the target); `None` on this backend.
    - `host_bytes_per_host`: the host memory of one host, `host_bytes *
        chips_per_host`: each chip's host-resident shards (and its own copy of each
        replicated host-resident array) are separate buffers in the RAM of the host
        that serves it. On this backend, `host_bytes`.
    - `params`, `opt_state`: bytes by memory kind between steps (`train_step` and
        `filter_offload` objects; `None` otherwise); on a TPU, the unpadded bytes of
        one chip's shards.
    - `residuals`: bytes saved for the backward pass, by checkpoint name and memory
        kind, as traced (`train_step` and `filter_offload` objects; `None`
        otherwise): whole arrays, summed over the chips of a slice, each in the
        dtype it is saved in. A `train_step`'s are those of what it
        differentiates: its loss on one micro-batch, computing from the
        `compute_dtype` copies (under `compute_dtype=jnp.bfloat16`, a carry
        computed from a bf16 embedding is saved in bf16, and so are the device's
        parameters cast for the backward pass). The compiler may still place a
        small residual elsewhere.
    - `largest_unnamed`: the largest values saved without a checkpoint name
        (`eo.UnnamedResidual` rows, up to three for each of `"(other)"`, outside
        every `Stacked`, and `"(unnamed, in stacked layers)"`), each with its
        shape, dtype, the operation and the line of your code that computed it.
    - `capacity`, `fits_device`: the device memory the compiler lets a program use
        on one chip of the target (15.75 GiB of a v5e's 16; on a GPU, the share of
        its memory JAX's allocator takes: 75% of an H100's 79.1 GiB by default) and
        whether `device_bytes` fits in it; `None` without a target (this backend).
    - `host_capacity`, `fits_host`: the host memory behind one chip of the target,
        the host's RAM over the chips it serves (`Hardware.host_memory_bytes`: 48 GB
        a v5e chip; from `memory_report(..., hardware=...)` when given), and whether
        `host_bytes` fits in it; `None` without a target. Comparing per chip is
        comparing per host: every chip of a host runs the same program, so
        `host_bytes_per_host` is within the host's RAM (`host_capacity *
        chips_per_host`) exactly when `host_bytes` is within `host_capacity`. It
        is the rule of `eo.plan`'s `host_budget`, also per device.
    - `fits`: both: `False` if either memory is exceeded, `True` if neither is,
        `None` if a capacity is unknown (as on the CPU).
    - `arguments`: bytes of each argument by memory kind (per chip on a TPU, as
        `params`).
    - `estimate`: `True` on the CPU backend, whose compiler does not tell host from
        device memory: the split there follows the leaves' memory kinds, and
        temporaries are counted as device memory.
    - `transfers`: the bytes moved host <-> device per step that the traced
        program asks for (`eo.Transfer` rows by direction, phase, what and name:
        each parameter, optimizer-state leaf and checkpoint name).
    - `compiled_transfers`: the same read from the compiled program, on a TPU or
        GPU target (`None` otherwise): what the compiler kept (it drops the moves of
        values nothing uses). A move of a value computed in the step that no named
        scope describes (a gradient, a residual, an accumulator) is `"computed"`.
    - `time`: the estimated step time on one device of the target (an
        `eo.StepTime`: compute, HBM and host-link times, what is not hidden, and
        what bounds it), read from the compiled program; `None` on the CPU
        backend.
    - `host_to_device_bytes`, `device_to_host_bytes`: the totals per step, from
        `compiled_transfers` where there are some, else from `transfers`;
        `transfer_bytes(direction, *, phase, what, compiled)` for a part.
    - `minimum_transfers`: the fewest bytes a `train_step` must move per step (a
        `MinimumTraffic`, residuals apart; `_report/_minimum.py` has the rules),
        printed under the transfers beside their total (`None` for other kinds).

    The compiler's `host["temp"]` is what it allocates in host memory for one chip
    while the step runs (e.g. a gradient gathered on the host before it is written
    back); like every figure here it is per chip, and it is not checked against
    anything the library computes. It leaves out what a host computation
    (`compute_on("device_host")`, `Policy(update="host")`) takes while it runs on
    the host's CPU: `host_compute_temp` estimates that from the compiled program
    (`_costs.Program.host_temporaries`: one array of the largest shape it
    computes), and `host_bytes` (so `fits_host` and `eo.plan`'s `host_budget`)
    counts it; 0 without host compute.
    """

    target: str
    kind: str  # what was compiled: "train_step", "filter_offload" or "function"
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
    def host_to_device_bytes(self) -> int:
        """Bytes moved from host to device memory per step: what the compiled
        program moves (`compiled_transfers`) on a TPU or GPU target, else what the
        traced program asks for (`transfers`)."""
        return self.transfer_bytes("host_to_device", compiled=self._compiled)

    @property
    def device_to_host_bytes(self) -> int:
        """Bytes moved from device to host memory per step, counted as
        `host_to_device_bytes` is."""
        return self.transfer_bytes("device_to_host", compiled=self._compiled)

    @property
    def _compiled(self) -> bool:
        return self.compiled_transfers is not None

    def transfer_bytes(
        self,
        direction: Literal["host_to_device", "device_to_host"],
        *,
        phase: Literal["forward/backward", "update"] | None = None,
        what: str | None = None,
        compiled: bool = False,
    ) -> int:
        """The bytes moved per step in one direction, of one phase and kind of
        value if given (`what`: `"params"`, `"opt_state"`, `"gradients"`,
        `"residuals"`, `"batch"`, `"other"`; in the compiled program also
        `"computed"`), from `transfers`, or from `compiled_transfers` if
        `compiled` (a TPU or GPU target's report has them)."""
        rows = self.compiled_transfers if compiled else self.transfers
        if compiled and rows is None:
            raise ValueError(
                "`MemoryReport.transfer_bytes(compiled=True)`: this report has no "
                "compiled transfers (they are read from a TPU or GPU compile: "
                "`memory_report(..., target='tpu-v5e')` or `target='gpu-h100'`)."
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
        """The host-link time of part of the compiled transfers
        (`transfer_bytes(..., compiled=True)` at the link's rate in `time`): e.g.
        `transfer_seconds("host_to_device", what="params")`."""
        if self.time is None:
            raise ValueError(
                "`MemoryReport.transfer_seconds`: this report has no step time "
                "(`time` is estimated for a TPU or GPU target: "
                "`memory_report(..., target='tpu-v5e')`)."
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
        """Whether `device_bytes` is within `capacity` (`None` if the target's
        capacity is not known, as on the CPU)."""
        return None if self.capacity is None else self.device_bytes <= self.capacity

    @property
    def fits_host(self) -> bool | None:
        """Whether `host_bytes` is within `host_capacity`, the host memory behind
        one chip (`None` if it is not known, as on the CPU)."""
        if self.host_capacity is None:
            return None
        return self.host_bytes <= self.host_capacity

    @property
    def fits(self) -> bool | None:
        """Whether the step fits both memories of one chip: `False` if it exceeds
        either (`fits_device`, `fits_host`), `None` if one is not known."""
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
        """The host memory of one host: `host_bytes` of each of the
        `chips_per_host` chips it serves (on this backend, `host_bytes`: the whole
        program runs on this machine)."""
        return self.host_bytes * (self.chips_per_host or 1)

    @property
    def _unit(self) -> str:
        return device_word(self.target)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data (bytes as ints)."""
        return {
            "target": self.target,
            "kind": self.kind,
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
            "residuals": None
            if self.residuals is None
            else [r._asdict() for r in self.residuals],
            "largest_unnamed": None
            if self.largest_unnamed is None
            else [r._asdict() | {"shape": list(r.shape)} for r in self.largest_unnamed],
            "chips": self.chips,
            "chips_per_host": self.chips_per_host,
            "host_bytes_per_host": self.host_bytes_per_host,
            "host_to_device_bytes": self.host_to_device_bytes,
            "device_to_host_bytes": self.device_to_host_bytes,
            "transfers": None
            if self.transfers is None
            else [t._asdict() for t in self.transfers],
            "compiled_transfers": None
            if self.compiled_transfers is None
            else [t._asdict() for t in self.compiled_transfers],
            "time": None if self.time is None else self.time.to_dict(),
            "host_compute_temp": self.host_compute_temp,
            "minimum_transfers": _minimum.to_dict(self.minimum_transfers),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MemoryReport":
        """The report `to_dict()` gave (read back from JSON, say): its derived
        figures (`device_bytes`, `fits`, ...) are computed again."""
        missing = {"target", "kind", "estimate", "device", "host"} - set(data)
        if missing:
            raise ValueError(
                "`MemoryReport.from_dict(data)` takes what `MemoryReport.to_dict()` "
                f"returns; `data` lacks {', '.join(sorted(missing))}."
            )

        def rows(key: str, row: Callable[..., Any]) -> Any:
            value = data.get(key)
            return None if value is None else tuple(row(**r) for r in value)

        return cls(
            target=data["target"],
            kind=data["kind"],
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
        """Draws where the memory lives: for this report and each of `others`, side
        by side, a stacked bar for the device and one for the host (per chip on a
        TPU), split into parameters, optimizer state, other arguments (the batch;
        on a TPU also the padding of arrays to the compiler's tiles),
        saved activations by checkpoint name (as traced; one-chip reports), the
        rest of the temporaries, what host compute takes while it runs
        (`host_compute_temp`), and outputs not written in place; under each
        label, the estimated step time and what bounds it (`time`). When a device
        bar comes within half of the chip's capacity, the capacity is drawn as a
        dashed line.

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
        what = DESCRIPTIONS[self.kind]
        if self.estimate:
            lines = [
                f"Memory report for {what}, compiled for this CPU backend",
                "(an estimate: XLA's CPU compiler has one memory, so the split follows "
                "the leaves' memory kinds",
                "and temporaries count as device memory)",
            ]
        elif self.chips is not None and self.chips > 1:
            hosts = self.chips // (self.chips_per_host or self.chips)
            lines = [
                f"Memory report for {what}, compiled for {self.target}: "
                f"{self.chips} {self._unit}s, {self.chips_per_host} per host "
                f"({hosts} host{'s' if hosts > 1 else ''})"
            ]
        else:
            lines = [f"Memory report for {what}, compiled for {self.target}"]
        per_chip = f"per {self._unit}" if self.chips is not None else ""
        header = f"{per_chip:<34}{'device':>14}{'host':>14}"
        lines += [header, "-" * len(header)]

        def row(label: str, device: int | None, host: int) -> None:
            shown = "" if device is None else size_text(device)
            lines.append(f"{label:<34}{shown:>14}{size_text(host):>14}")

        row("footprint", self.device_bytes, self.host_bytes)
        for part, label in zip(PARTS, ("arguments", "outputs", "temporaries")):
            row(f"  {label}", self.device[part], self.host[part])
        if self.host_compute_temp:
            row("  host compute temporaries", None, self.host_compute_temp)
        row(
            "  aliased (donated, counted once)",
            -self.device["alias"],
            -self.host["alias"],
        )
        if self.capacity is not None or self.host_capacity is not None:
            lines.append(
                f"{f'capacity of one {self._unit}':<34}"
                f"{_size_or_blank(self.capacity):>14}"
                f"{_size_or_blank(self.host_capacity):>14}"
            )
            lines.append(
                f"{'  verdict':<34}{_verdict(self.fits_device):>14}"
                f"{_verdict(self.fits_host):>14}"
            )
            if self.fits_host is False:
                lines.append("  the host memory is exceeded; to shrink it:")
                for advice in host_advice(
                    self.target,
                    self.opt_state,
                    self.residuals,
                    self.host_capacity or 0,
                    device_room=self.fits_device is True,
                ):
                    lines += textwrap.wrap(
                        advice,
                        80,
                        initial_indent="    - ",
                        subsequent_indent="      ",
                        break_on_hyphens=False,
                    )
        if self.chips is not None and self.chips > 1:
            label = f"host memory of a host ({self.chips_per_host} {self._unit}s)"
            row(label, None, self.host_bytes_per_host)
        for label, by_kind in (
            ("parameters", self.params),
            ("optimizer state", self.opt_state),
        ):
            if by_kind is not None:
                row(label, by_kind.get("device", 0), host_total(by_kind))
        if self.residuals is not None:
            if self.chips is not None and self.chips > 1:
                lines.append("saved for the backward pass (as traced, whole arrays)")
            else:
                lines.append("saved for the backward pass (as traced)")
            totals: dict[str, dict[str, int]] = defaultdict(dict)
            for r in self.residuals:
                totals[r.name][r.memory_kind] = r.bytes
            for name, by_kind in totals.items():
                row(f"  {name}", by_kind.get("device", 0), host_total(by_kind))
                lines += _unnamed_lines(self.largest_unnamed or (), name)
            if not totals:
                lines.append("  (nothing)")
            lines += _unnamed_hints({name for name in totals if name in UNNAMED})
        if self.params is None:
            lines.append("arguments")
            for name, by_kind in self.arguments.items():
                row(f"  {name}", by_kind.get("device", 0), host_total(by_kind))
        if self.transfers:
            lines += _traffic.table_lines(self.transfers, "as traced")
        if self.compiled_transfers:
            lines += _traffic.table_lines(self.compiled_transfers, "as compiled")
        lines += _minimum.table_lines(self)
        if self.time is not None:
            lines += _step_time.lines(self.time)
        return "\n".join(lines)


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


def _unnamed_hints(groups: set[str]) -> list[str]:
    """How to shrink the unnamed groups the table shows."""
    hints = {
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
    return [line for group in UNNAMED if group in groups for line in hints[group]]


def device_word(target: str) -> str:
    """What one device of `target` is called in reports and errors: "GPU" for the
    `gpu-*` targets, "chip" otherwise."""
    return "GPU" if target.startswith("gpu-") else "chip"


def host_total(by_kind: dict[str, int]) -> int:
    return sum(v for k, v in by_kind.items() if k != "device")
