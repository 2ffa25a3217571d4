"""`StepTime`: an estimate of how long one step takes on a target, read from the
program `memory_report` compiled, without running it.

The compiled program is scheduled: each computation's instructions are in the
order one device issues them, and each host transfer the compiler kept is an
asynchronous start ... done pair (or a synchronous copy). The estimate replays
that order once per computation, with a clock:

- an instruction that computes (a fusion, a dot, a copy, a collective, ...) takes
    the longer of its matmul FLOPs at the precision it runs at, and the bytes it
    reads and writes in device memory at the HBM bandwidth (a roofline per
    instruction; elementwise work is priced by its bytes), over
    `Hardware.compute_efficiency`;
- a transfer between host and device memory occupies the host link in its
    direction for its bytes at that direction's rate, from when it is issued
    (`Hardware.host_to_device_bytes_per_second`, `device_to_host_...`). While both
    directions move, together they move at most
    `Hardware.both_ways_bytes_per_second` (on the H200 that is one direction's
    rate: the two took turns). Of its time, the share `Hardware.transfer_overlap`
    can run beside the device work issued between its start and its done; the
    device waits for the rest when it issues the transfer, and at the `done` for
    what the work in between did not cover. A synchronous transfer hides nothing.
    (On the H200 the share measured 0: every transfer held the device up.)
    A called computation (a loop's body, a branch) starts its transfers once the
    link has moved what the caller still has in flight;
- host compute (`compute_on("device_host")`: a host computation the device
    starts and later waits for, or an instruction marked to run on the host)
    occupies the host's CPU for the longer of its host-memory bytes at the host's
    memory bandwidth and its FLOPs at the host's FLOP/s (`_costs.Program.host_work`
    says which bytes and FLOPs). Like a transfer it runs from when it is issued,
    one region at a time, and the device waits at its `done` for what the
    device work scheduled in between did not cover; a synchronous one hides
    nothing;
- a `while` loop takes its body's time once per trip (the trip count the compiler
    knows, else read from the loop's condition), so what is hidden is hidden per
    iteration, as scheduled; a called computation takes its time where it is
    called; of a `conditional`, the first branch.

`compiled.cost_analysis()` is not used: it counts a loop's body once, prices host
transfers as device-memory traffic, and gives negative times for some programs.
Not modelled: interconnect (collectives are priced as device-memory traffic),
kernel launch and per-op overheads, caches, host compute and host transfers
sharing the host's memory bandwidth. The text is read in `_compiler.py`.
"""

import dataclasses
from typing import Any, Literal

from .. import _compiler
from .._errors import see
from . import _hardware
from ._costs import Program
from ._hardware import Hardware
from ._replay import Replay
from ._units import flops_text, header, row, size_text, time_text


Bound = Literal["compute", "HBM", "host link", "host compute"]

# The parts of a step `exposed_seconds_by_phase` splits the exposed link time into.
PHASES: tuple[_compiler.Phase, ...] = ("forward", "backward", "outside", "update")
_PHASE_LABELS = {
    "forward": "of which layers, forward",
    "backward": "of which layers, backward",
    "outside": "of which outside the layers",
    "update": "of which the update",
}
Kind = Literal["device", "host link", "host compute"]

# Shown for a GPU program with batched matmuls (attention has them; so may other
# code: the note says "if").
ATTENTION_NOTE = (
    "if this step computes attention, it is priced as XLA computes it, its scores "
    "through device memory: a compile without a GPU has no cuDNN fused attention, "
    "which keeps them on chip, so on the GPU the step may be faster than this"
)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """How long one step takes on one device of the target.

    It is estimated from the compiled program (`MemoryReport.time`; `None` on the CPU
    backend). Figures are seconds per step. Every figure is per device and non-negative.

    - `seconds`: the estimated step time.
    - `bound`: what most of it is spent on. `"compute"`: instructions limited by their
        matmul FLOPs. `"HBM"`: limited by device-memory traffic. `"host link"`: waiting
        for host transfers. `"host compute"`: waiting for work on the host's CPU.
    - `compute_seconds`: matmul FLOPs at the hardware's rate for the precision each dot
        runs at. `flops` is their number (with loop trip counts). `flops_by_precision`
        splits it by precision (`"bf16"`, `"tf32"`, ...).
    - `hbm_seconds`: the bytes instructions read and write in device memory
        (`hbm_bytes`) at the HBM bandwidth.
    - `host_to_device_seconds`, `device_to_host_seconds`: the host link busy in each
        direction. That is `host_to_device_bytes`, `device_to_host_bytes` at the link's
        rate. (What the compiled program moves, as `MemoryReport.compiled_transfers`.)
    - `exposed_transfer_seconds`: the part of the host-link time the device waits for.
        It is not hidden behind the compute scheduled between a transfer's start and its
        done. A synchronous transfer hides nothing.
    - `hardware`: the `eo.Hardware` it was priced with.
    - `host_compute_seconds`: the host's CPU busy with host compute.
        (`compute_on("device_host")`, as `Policy(update="host")` runs the optimizer
        update.) Each region takes the longer of two times. One is its host-memory bytes
        (`host_compute_bytes`, read and written) at
        `hardware.host_memory_bytes_per_second`. The other is its FLOPs
        (`host_compute_flops`) at `hardware.host_flops`. 0 without host compute, and in
        results saved before these fields existed.
    - `exposed_host_compute_seconds`: the part of it the device waits for. It is not
        hidden behind the device work scheduled while the host computes.
    - `exposed_seconds_by_phase`: `exposed_transfer_seconds` by the part of the step
        whose transfer the device waits for. `"forward"` and `"backward"`: the scans of
        `Stacked` layers. `"outside"`: leaves outside every `Stacked` (an embedding, a
        head). Their reads cannot hide before the first layer. `"update"`: the optimizer
        update. The parts sum to `exposed_transfer_seconds`. It is empty in results
        saved before it existed.
    - `transfer_seconds_by_phase`: the host link busy (both directions) by the same
        parts. That is each part's bytes at the link's rates.
    - `kind`: `"device"` for a step without host traffic, `"host link"` for one that
        moves bytes to or from the host, `"host compute"` for one that computes on
        the host's CPU.
    - `error`: how far the estimate has been off for this kind of step on this
        hardware (`hardware.error[kind]`, relative): a measured step is expected
        within `seconds × (1 ± error)`. `hardware.label("error")` says whether that
        was measured.
    - `compile_options`: the compiler options the library compiled the step with
        (`Policy(host_remat=True)` sets one; `{}` for none).
    - `notes`: what the estimate leaves out for this program (on a GPU, the fused
        attention kernels a compile without a GPU does not have).
    - `compute_bound_seconds`: the same replay with host transfers and host compute
        priced at zero: the step if nothing waited for the host. (0 in results saved
        before it existed.)
    - `model_flops`: the FLOPs the model needs per step, per device: 3 × the matmul
        FLOPs of the loss's forward pass on the batch of one update (forward 1,
        backward 2), over the devices. It counts attention's matmuls (a causal mask
        halves nothing, as in PaLM's and MaxText's MFU), and no recomputation.
        `None` where the report does not know the loss (a function, not an
        `eo.TrainStep`), or the loss could not be traced outside the step.
    - `mfu` (a property): model FLOPs utilisation, `model_flops / (seconds ×
        peak_flops)`; `None` without `model_flops`. `peak_flops` is
        `hardware.matmul_flops` at the step's compute `precision`: the precision with
        the most FLOPs in `flops_by_precision` (`"bf16"` for a step without
        matmuls). The compute-bound step's MFU is `mfu × seconds /
        compute_bound_seconds`.
    """

    seconds: float
    bound: Bound
    compute_seconds: float
    flops: float
    flops_by_precision: dict[str, float]
    hbm_seconds: float
    hbm_bytes: float
    host_to_device_seconds: float
    host_to_device_bytes: int
    device_to_host_seconds: float
    device_to_host_bytes: int
    exposed_transfer_seconds: float
    hardware: Hardware
    host_compute_seconds: float = 0.0
    host_compute_bytes: int = 0
    host_compute_flops: float = 0.0
    exposed_host_compute_seconds: float = 0.0
    exposed_seconds_by_phase: dict[str, float] = dataclasses.field(default_factory=dict)
    transfer_seconds_by_phase: dict[str, float] = dataclasses.field(
        default_factory=dict
    )
    kind: Kind = "device"
    error: float = 0.0
    compile_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    compute_bound_seconds: float = 0.0
    model_flops: float | None = None

    @property
    def precision(self) -> str:
        """The step's compute precision: the one with the most of its FLOPs."""
        by = self.flops_by_precision
        return max(by, key=by.__getitem__, default="bf16")

    @property
    def peak_flops(self) -> float:
        """The matmul FLOP/s of `hardware` at the step's compute `precision`."""
        return self.hardware.flops_per_second(self.precision)[1]

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: `model_flops / (seconds × peak_flops)`."""
        if self.model_flops is None or self.seconds <= 0:
            return None
        return self.model_flops / (self.seconds * self.peak_flops)

    @property
    def range(self) -> tuple[float, float]:
        """The seconds a measured step is expected within: `seconds × (1 ± error)`."""
        return self.seconds * (1 - self.error), self.seconds * (1 + self.error)

    def to_dict(self) -> dict[str, Any]:
        """Its fields as JSON-serialisable data, with `mfu` (`from_dict` reads them
        back and computes `mfu` again)."""
        out = dataclasses.asdict(self)  # (copies the dicts, `hardware` too)
        hardware, notes = self.hardware.to_dict(), list(self.notes)
        return out | {"hardware": hardware, "notes": notes, "mfu": self.mfu}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepTime":
        """The `StepTime` `to_dict()` gave (read back from JSON, say).

        The host compute fields of results saved before they existed are 0.
        """
        fields = {f.name for f in dataclasses.fields(cls)} - {"hardware"}
        kept: dict[str, Any] = {k: v for k, v in data.items() if k in fields}
        kept["notes"] = tuple(kept.get("notes", ()))
        return cls(**kept, hardware=Hardware.from_dict(data["hardware"]))

    def __str__(self) -> str:
        return "\n".join(lines(self))


def lines(t: StepTime) -> list[str]:
    """The step-time section of a report's table."""
    by = ", ".join(f"{p} {flops_text(n)}" for p, n in t.flops_by_precision.items())
    error = f"±{t.error:.0%} ({t.hardware.label('error')} for a {t.kind} step)"
    flops = flops_text(t.flops) + (f": {by}" if by else "")
    rows = [
        ("step time (estimate)", t.seconds, f"{t.bound}-bound, {error}"),
        ("  compute", t.compute_seconds, flops),
        ("  HBM", t.hbm_seconds, size_text(int(t.hbm_bytes))),
    ]
    for way, to in (("host_to_device", "device"), ("device_to_host", "host")):
        seconds, nbytes = getattr(t, f"{way}_seconds"), getattr(t, f"{way}_bytes")
        rows.append((f"  host link to {to}", seconds, size_text(nbytes)))
    rows.append(("  transfers not hidden", t.exposed_transfer_seconds, ""))
    for phase in PHASES:
        if seconds := t.exposed_seconds_by_phase.get(phase, 0.0):
            rows.append((f"    {_PHASE_LABELS[phase]}", seconds, ""))
    if t.host_compute_seconds or t.host_compute_bytes:  # (only with host compute)
        work = f"{size_text(t.host_compute_bytes)}, {flops_text(t.host_compute_flops)}"
        rows.append(("  host compute", t.host_compute_seconds, work))
        rows.append(("  host compute not hidden", t.exposed_host_compute_seconds, ""))
    if t.compute_bound_seconds:  # (0 in results saved before it existed)
        ratio = f"step / compute-bound {t.seconds / t.compute_bound_seconds:.2f}x"
        rows.append(("compute-bound step (estimate)", t.compute_bound_seconds, ratio))
    out = header(f"time per step, {t.hardware.name}", "seconds")
    out += [f"{row(label, time_text(s))}  {note}".rstrip() for label, s, note in rows]
    if t.mfu is not None:
        peak = f"{t.precision} peak, {flops_text(t.peak_flops)}/s"
        note = f"{flops_text(t.model_flops or 0)} of model FLOPs at {peak}"
        out.append(f"{row('MFU (estimate)', f'{t.mfu:.1%}')}  {note}")
    out.append(f"rates: {t.hardware.rates_text()}")
    if t.compile_options:
        given = ", ".join(f"{k}={v}" for k, v in t.compile_options.items())
        out.append(f"compiled with: {given}")
    out.extend(f"note: {note}" for note in t.notes)
    return out


def hardware_for(
    target: str | None, platform: str, hardware: Hardware | None
) -> Hardware | None:
    """The rates `memory_report(..., target=target, hardware=hardware)` prices its step
    at.

    It compiles for `platform`. The rates are `hardware`, or the table's entry for the
    target (or this backend's device). None where there is none.
    """
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(
            f"`memory_report(hardware=...)` takes an `eo.Hardware`, not "
            f"{type(hardware).__name__}. Use e.g. `eo.Hardware.of('tpu-v5e')`."
            + see(110)
        )
    timed = platform in ("tpu", "gpu")
    if not timed and hardware is not None:
        raise ValueError(
            f"`memory_report(hardware=...)`: a {platform} program has no TPU or GPU "
            "time. Pass a `target=` too." + see(109)
        )
    if hardware is not None or not timed:
        return hardware
    return _hardware.of_this_backend() if target is None else Hardware.of(target)


def estimate(
    text: str | Program,
    hardware: Hardware,
    platform: str,
    compile_options: dict[str, Any] | None = None,
) -> StepTime:
    """The step time of a compiled program (`compiled.as_text()`, or that text
    parsed: a `Program`, to price one program at several rates), compiled for
    `platform` ("tpu" or "gpu") with `compile_options`, on `hardware`; without
    `model_flops` (`memory_report` knows the loss)."""
    program = text if isinstance(text, Program) else Program(text, platform)
    tally = Replay(program, hardware).run(program.entry)
    host_free = Replay(program, _host_free(hardware)).run(program.entry)
    h2d = tally.link_bytes.get("host_to_device", 0)
    d2h = tally.link_bytes.get("device_to_host", 0)
    kind: Kind = (
        "host compute" if tally.host else "host link" if h2d or d2h else "device"
    )
    batched = platform == "gpu" and program.has_batched_dots()
    notes = (ATTENTION_NOTE,) if batched else ()
    parts: dict[Bound, float] = {
        "compute": tally.compute_bound,
        "HBM": tally.hbm_bound,
        "host link": tally.exposed,
        "host compute": tally.host_bound,
    }
    return StepTime(
        seconds=float(tally.seconds),
        bound=max(parts, key=lambda k: parts[k]),
        compute_seconds=float(tally.compute),
        flops=float(sum(tally.flops.values())),
        flops_by_precision={p: float(n) for p, n in tally.flops.items() if n},
        hbm_seconds=float(tally.hbm),
        hbm_bytes=float(tally.hbm_bytes),
        host_to_device_seconds=h2d / hardware.host_to_device_bytes_per_second,
        host_to_device_bytes=h2d,
        device_to_host_seconds=d2h / hardware.device_to_host_bytes_per_second,
        device_to_host_bytes=d2h,
        exposed_transfer_seconds=float(tally.exposed),
        hardware=hardware,
        exposed_seconds_by_phase={p: tally.exposed_by_phase[p] for p in PHASES},
        transfer_seconds_by_phase={p: tally.link_by_phase[p] for p in PHASES},
        host_compute_seconds=float(tally.host),
        host_compute_bytes=int(tally.host_bytes),
        host_compute_flops=float(tally.host_flops),
        exposed_host_compute_seconds=float(tally.host_bound),
        kind=kind,
        error=float(hardware.error[kind]),
        compile_options=dict(compile_options or {}),
        notes=notes,
        compute_bound_seconds=float(host_free.seconds),
    )


def _host_free(hw: Hardware) -> Hardware:
    """`hw` with the host link and the host's CPU free (at rates that make their
    time nothing worth counting): the compute-bound step."""
    ways = ("host_to_device", "device_to_host", "both_ways", "host_memory")
    free = {f"{way}_bytes_per_second": 1e300 for way in ways}
    return dataclasses.replace(hw, **free, host_flops=1e300)
