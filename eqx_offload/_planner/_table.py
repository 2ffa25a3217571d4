"""What `plan` shows: a row per candidate considered, and the table of them.

`PlanRow` is a row. `PlanTable` is the table, printable and convertible to a dict.
"""

import dataclasses
import textwrap
from typing import Any, NamedTuple

from .._policy import Policy
from .._report import size_text, time_text
from . import _rates


# The width of the labels' column, less the space before the next.
LABEL_WIDTH = 44


class PlanRow(NamedTuple):
    """One candidate `plan` considered.

    - `label`: what it places where, different for each candidate. For example
        `"params on host: blocks; offload blocks.input"`.
    - `policy`: the `Policy` it trains with.
    - `status`: `"chosen"` or `"compiled"`. Otherwise, why it was not compiled
        (`"pruned: ..."`) or did not compile (`"does not compile: ..."`).
    - `device_bytes`, `host_bytes`: per device, from the compiled program. `None`
        if not compiled. For a program the compiler found too big, its figure.
    - `fits`: within both budgets. `None` if not compiled.
    - `seconds`, `bound`: the estimated step time and what bounds it
        (`MemoryReport.time`).
    - `transfer_bytes`: host <-> device bytes per step.
    - `recomputed_flops`: matmul FLOPs beyond those of the step without remat.
    - `error`: how far `seconds` can be off, relative (`MemoryReport.time.error`):
        a measured step is expected within `seconds × (1 ± error)` (`range`).
    - `kind`: what the step's host traffic makes it, for that error: `"device"`,
        `"host link"` or `"host compute"` (`MemoryReport.time.kind`).
    - `rates`: the rates the estimate used, each with where its figure comes from:
        `(("compute", "nominal"), ("HBM", "nominal"), ("link", "measured"))`
        (`eo.Hardware.label`; a rate resting on several figures has the least
        trusted of them).
    - `tied`: it fits and its estimate is within the error of the fastest's
        (`plan`'s choice is among these). `None` if it does not fit.
    - `microbatches`: the micro-batches of its step.
    - `compute_bound_seconds`, `mfu`: the same estimate with host transfers and
        host compute priced at zero, and the model FLOPs utilisation of the step
        (`MemoryReport.time`); `None` where not known.
    """

    label: str
    policy: Policy
    status: str
    device_bytes: int | None = None
    host_bytes: int | None = None
    fits: bool | None = None
    seconds: float | None = None
    bound: str | None = None
    transfer_bytes: int | None = None
    recomputed_flops: float | None = None
    error: float | None = None
    kind: str | None = None
    rates: tuple[tuple[str, str], ...] = ()
    tied: bool | None = None
    microbatches: int = 1
    compute_bound_seconds: float | None = None
    mfu: float | None = None

    @property
    def range(self) -> tuple[float, float] | None:
        """The seconds a measured step is expected within: `seconds × (1 ±
        error)`."""
        if self.seconds is None or self.error is None:
            return None
        return self.seconds * (1 - self.error), self.seconds * (1 + self.error)

    @property
    def rates_text(self) -> str:
        """`rates` in words: `"link measured; compute, HBM nominal"`."""
        return _rates.text(self.rates)

    def to_dict(self) -> dict[str, Any]:
        return self._asdict() | {
            "policy": repr(self.policy),
            "rates": dict(self.rates),
            "range": self.range,
        }


@dataclasses.dataclass(frozen=True)
class PlanTable:
    """Every candidate `plan` considered (`rows`), printable as a table.

    - `device_budget`: the device bytes a candidate may use: the budget given (or
        the target's capacity) less `workspace_margin`.
    - `host_budget`: the host bytes per device a candidate may use.
    - `workspace_margin`: the device bytes left free for what a compile without the
        device cannot see (`plan(workspace_margin=...)`).
    - `decision`: why the chosen row was chosen, where it is not the fastest by
        estimate (a tie within the estimates' error); else empty.
    - `interrupted`: the planning was stopped (Ctrl-C) before its search ended.

    A label longer than its column goes on over the lines below its row. Each row
    with a step time shows its error (`±`) and the rates it used.
    """

    rows: tuple[PlanRow, ...]
    device_budget: int
    host_budget: int
    workspace_margin: int = 0
    decision: str = ""
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        # All but the rows, then them.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[1:]} | {
            "rows": [r.to_dict() for r in self.rows]
        }

    def __str__(self) -> str:
        device = f"{size_text(self.device_budget)} device"
        if self.workspace_margin:
            device += (
                f" ({size_text(self.workspace_margin)} of "
                f"{size_text(self.device_budget + self.workspace_margin)} left free "
                "for workspaces a compile without the device cannot see)"
            )
        budgets = f"budgets per device: {device}, {size_text(self.host_budget)} host"
        rates = [r.rates_text for r in self.rows]
        width = max(map(len, rates), default=0)

        def column(text: str) -> str:  # the rates, where some row has them
            return f"{text:<{width}}  " if width else ""

        header = (
            f"{'candidate':<46}{'device':>11}{'host':>11}{'step':>10}{'±':>6}"
            f"{'compute':>10}{'MFU':>6}{'moved':>11}  {column('rates')}status"
        )
        lines = [budgets, header, "-" * (len(header) + 10)]
        for r, rate in zip(self.rows, rates):
            label, *more = _wrap(r.label)
            error = "" if r.error is None or r.seconds is None else f"{r.error:.0%}"
            fits = "" if r.fits is None else (" fits" if r.fits else " too big")
            tied = ", tied" if r.tied and r.status != "chosen" else ""
            bound = _time(r.compute_bound_seconds if r.seconds else None)
            mfu = "" if r.mfu is None else f"{r.mfu:.0%}"
            lines.append(
                f"{label:<46}{_size(r.device_bytes):>11}{_size(r.host_bytes):>11}"
                f"{_time(r.seconds):>10}{error:>6}{bound:>10}{mfu:>6}"
                f"{_size(r.transfer_bytes):>11}  {column(rate)}{r.status}{fits}{tied}"
            )
            lines += more
        if self.decision:
            lines += ["", self.decision]
        if any(r.tied is not None for r in self.rows):
            lines += [
                "",
                "±: how far a step time can be off (what the model has shown for "
                "its kind of step). compute: the step's compute-bound time (host "
                "transfers and host compute free); MFU: its model FLOPs "
                "utilisation. tied: within that of the fastest; of those, "
                "the plan is one without experimental stages, then the one that "
                "leaves the most device memory free (up to a tenth of the "
                "budget), then the fastest.",
            ]
        return "\n".join(lines)


def _size(n: int | None) -> str:
    return "" if n is None else size_text(n)


def _time(seconds: float | None) -> str:
    return "" if seconds is None else time_text(seconds)


def _wrap(label: str) -> list[str]:
    """A label in lines of the table's first column.

    It is whole, broken at spaces. A word longer than the column breaks at its
    width. The lines after the first are indented.
    """
    return textwrap.wrap(
        label, LABEL_WIDTH, subsequent_indent="  ", break_on_hyphens=False
    ) or [""]
