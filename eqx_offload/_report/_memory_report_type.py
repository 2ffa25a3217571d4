"""`MemoryReport` and its rows: where a step's bytes live.

They are figures, and the table `str(report)` prints. `memory_report` in
`_memory_report.py` builds it.
"""

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, NoReturn

from .._errors import see
from . import _memory_table, _plot
from ._memory_table import DESCRIPTIONS as DESCRIPTIONS, UNNAMED as UNNAMED
from ._step_time import StepTime
from ._targets import HostLimit
from ._traffic import Transfer


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
    - `host_limit`: what bounds `host_capacity`: `"RAM"`, the host's RAM per device,
        or on a GPU `"pinned host cap"`, where JAX's cap on pinned host memory is
        lower. That cap is `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` GiB per process (64 by
        default, 16 with `XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`), shared by the
        `chips_per_host` GPUs one process drives. `None` on this backend.
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
    host_limit: HostLimit | None = None  # what bounds `host_capacity`

    @property
    def kind(self) -> NoReturn:
        """Of earlier versions; now `compiled` (reading it raises an error)."""
        raise AttributeError(_KIND_IS_COMPILED)

    @property
    def host_to_device_bytes(self) -> int:
        """Bytes moved from host to device memory per step. They come from
        `compiled_transfers` on a TPU or GPU target, else from `transfers`."""
        compiled = self.compiled_transfers is not None
        return self.transfer_bytes("host_to_device", compiled=compiled)

    @property
    def device_to_host_bytes(self) -> int:
        """Bytes moved from device to host memory per step, as
        `host_to_device_bytes`."""
        compiled = self.compiled_transfers is not None
        return self.transfer_bytes("device_to_host", compiled=compiled)

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
        rate = getattr(self.time.hardware, f"{direction}_bytes_per_second")
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
        both = (self.fits_device, self.fits_host)
        return False if False in both else None if None in both else True

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

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data (bytes as ints), with its derived
        figures."""
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return out | {name: getattr(self, name) for name in _DERIVED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MemoryReport":
        """The report `to_dict()` gave (read back from JSON, say). Its derived figures
        (`device_bytes`, `fits`, ...) are computed again."""
        if "compiled" not in data and "kind" in data:  # saved before the rename
            data = {**data, "compiled": data["kind"]}
        if missing := {"target", "compiled", "estimate", "device", "host"} - set(data):
            raise ValueError(
                f"`MemoryReport.from_dict(data)`: `data` lacks "
                f"{', '.join(sorted(missing))}. Pass what `to_dict()` returns."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {"capacity": None, "arguments": {}}
        for name, value in data.items():
            if name in _ROWS and value is not None:  # (lists in them for tuples)
                value = tuple(_ROWS[name](**_tuples(r)) for r in value)
            elif name == "time" and value is not None:
                value = StepTime.from_dict(value)
            if name in fields:
                out[name] = value
        return cls(**out)

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
        return "\n".join(_memory_table.lines(self))


# What `to_dict` adds to the fields: the figures derived from them (its properties
# but `kind`, which raises).
_DERIVED = [
    k for k, v in vars(MemoryReport).items() if isinstance(v, property) and k != "kind"
]


def _plain(value: Any) -> Any:
    """A field as JSON-serialisable data: rows as dicts (tuples in them as lists),
    a `StepTime` by its `to_dict`."""
    if isinstance(value, StepTime):
        return value.to_dict()
    if isinstance(value, tuple):
        return [
            {k: list(v) if isinstance(v, tuple) else v for k, v in r._asdict().items()}
            for r in value
        ]
    return copy.deepcopy(value)  # the dicts of bytes, not shared with the report


def _tuples(row: dict[str, Any]) -> dict[str, Any]:
    """A row's fields from JSON, with tuples for its lists (as `_plain` wrote)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in row.items()}


# The rows `from_dict` reads back, by field.
_ROWS: dict[str, Callable[..., Any]] = {
    "residuals": ResidualRow,
    "largest_unnamed": UnnamedResidual,
    "transfers": Transfer,
    "compiled_transfers": Transfer,
}
