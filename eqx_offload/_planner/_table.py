"""What `plan` shows: a row per candidate considered, and the table of them.

`PlanRow` is a row. `PlanTable` is the table, printable and convertible to a dict.
"""

import dataclasses
import textwrap
from typing import Any, NamedTuple

from .._policy import Policy
from .._report import size_text, time_text


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

    def to_dict(self) -> dict[str, Any]:
        return self._asdict() | {"policy": repr(self.policy)}


@dataclasses.dataclass(frozen=True)
class PlanTable:
    """Every candidate `plan` considered (`rows`), printable as a table.

    A label longer than its column goes on over the lines below its row.
    """

    rows: tuple[PlanRow, ...]
    device_budget: int
    host_budget: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_budget": self.device_budget,
            "host_budget": self.host_budget,
            "rows": [r.to_dict() for r in self.rows],
        }

    def __str__(self) -> str:
        budgets = (
            f"budgets per device: {size_text(self.device_budget)} device, "
            f"{size_text(self.host_budget)} host"
        )
        header = (
            f"{'candidate':<46}{'device':>11}{'host':>11}{'step':>10}"
            f"{'moved':>11}  status"
        )
        lines = [budgets, header, "-" * (len(header) + 10)]
        for r in self.rows:
            label, *more = _wrap(r.label)

            def cell(n: int | None) -> str:
                return "" if n is None else size_text(n)

            step = "" if r.seconds is None else time_text(r.seconds)
            fits = "" if r.fits is None else (" fits" if r.fits else " too big")
            lines.append(
                f"{label:<46}{cell(r.device_bytes):>11}{cell(r.host_bytes):>11}"
                f"{step:>10}{cell(r.transfer_bytes):>11}  {r.status}{fits}"
            )
            lines += more
        return "\n".join(lines)


def _wrap(label: str) -> list[str]:
    """A label in lines of the table's first column.

    It is whole, broken at spaces. A word longer than the column breaks at its
    width. The lines after the first are indented.
    """
    return textwrap.wrap(
        label, LABEL_WIDTH, subsequent_indent="  ", break_on_hyphens=False
    ) or [""]
