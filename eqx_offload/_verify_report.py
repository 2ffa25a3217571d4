"""What `verify` reports.

- `Difference`: the largest difference of each check.
- `VerifyReport`: the report.
- `DoesNotMatch`: the error a failed check raises.
"""

import dataclasses
from typing import NamedTuple, NoReturn

from ._errors import see


_UPSTREAM = (
    "Offloading and remat change where values are stored and what is recomputed, "
    "never the mathematics, so a difference beyond rounding is a bug: in the step, "
    "or in the compiler (upstream XLA has produced silently wrong gradients for "
    "offloaded scan residuals on GPU, openxla/xla#46231). Narrow it down by "
    "verifying with less offloading (`Policy.offload_residuals()`, then "
    "`Policy.remat()`, `opt_state='device'`, `update='whole'`) and train with the "
    "policy that passes."
)


_REFERENCE = "the reference (every leaf on the device, no remat)"
# Each check's failure: what differs (of its leaf), from what, the scale of its
# tolerance, and the link to the error catalogue's entry.
_FAILURES = {
    "loss": ("the {}", _REFERENCE, "the reference loss", see(67)),
    "gradients": (
        "the gradient of leaf {!r}",
        _REFERENCE,
        "the largest entry of the reference gradient",
        see(68),
    ),
    "update": (
        "leaf {!r} after the streamed update",
        "the whole update (`Policy(update='whole')`: plain optax)",
        "the largest change of a parameter in the whole update, which also "
        "allows one rounding of the parameter; the largest entry of a state leaf",
        see(67),
    ),
}


class DoesNotMatch(ValueError):
    """Raised by `verify` when the offloaded step differs from the reference.

    It differs beyond the tolerance. The message names the check, the leaf and the
    difference. `error.report` holds every check's largest difference.
    """

    report: "VerifyReport"

    def __init__(self, message: str, report: "VerifyReport"):
        super().__init__(message)
        self.report = report


class Difference(NamedTuple):
    """The largest difference one check found, relative to its tolerance."""

    leaf: str
    """The leaf (its dotted path; `"loss"` for the loss) nearest to its tolerance."""
    difference: float
    """The largest absolute difference over that leaf."""
    scale: float
    """What the tolerance is relative to: the reference's largest magnitude there.

    For parameters after the update, it is the largest change.
    """
    tolerance: float
    """`atol + rtol * scale`, plus one rounding for a parameter after the update.

    The check passes if `difference <= tolerance`.
    """

    @property
    def passed(self) -> bool:
        return self.difference <= self.tolerance


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What `verify` compared, and the largest difference of each check.

    Print it for a table.

    - `loss`: the offloaded loss against the reference loss.
    - `gradients`: each leaf's offloaded gradient against the reference gradient.
        It holds the leaf nearest to its tolerance.
    - `update`: the model and optimizer state after the streamed update, against
        those after the whole update. `None` when not checked. That is when the
        step does not stream (`Policy(update="whole")`, or nothing
        parameter-shaped on the host). It is also when the loss or gradients
        already differ.
    - `layers`: the layers kept of each `Stacked`. `None` means every layer.
    - `examples`: how many examples the checked batch holds (its leading axis).
        `None` for a batch without one. Fewer than `verify(examples=...)` asked
        for when the batch is smaller.
    - `whole_batch`: whether those are the whole batch.
    - `microbatches`: how many micro-batches the step split them into.
    """

    loss: Difference
    gradients: Difference
    update: Difference | None
    layers: int | None
    examples: int | None
    whole_batch: bool
    microbatches: int

    @property
    def microbatch(self) -> NoReturn:
        raise AttributeError(
            "`VerifyReport.microbatch` is now `.examples` (how many were checked) "
            "and `.whole_batch`." + see(143)
        )

    @property
    def passed(self) -> bool:
        checks = (self.loss, self.gradients, self.update)
        return all(c.passed for c in checks if c is not None)

    def __str__(self) -> str:
        rows = [("check", "leaf", "max |difference|", "tolerance", "")]
        for name in ("loss", "gradients", "update"):
            check = getattr(self, name)
            if check is None:
                rows.append((name, "(not checked)", "-", "-", ""))
                continue
            verdict = "ok" if check.passed else "FAILED"
            difference, tolerance = f"{check.difference:.3g}", f"{check.tolerance:.3g}"
            rows.append((name, check.leaf, difference, tolerance, verdict))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"eqx_offload.verify: {_slice_text(self)}"] + [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4]
            for row in rows
        ]
        return "\n".join(line.rstrip() for line in lines)


def _slice_text(report: VerifyReport) -> str:
    """What was checked: "the first 2 layers of each `Stacked`, the first 2
    examples"."""

    def first(n: int, noun: str) -> str:
        return f"the first {noun}" if n == 1 else f"the first {n} {noun}s"

    layers, examples = report.layers, report.examples
    where = "every layer" if layers is None else first(layers, "layer")
    if not report.whole_batch and examples is not None:
        what = first(examples, "example")
    else:
        what = "the whole batch"
        if examples is not None:
            what += f" ({examples} example{'' if examples == 1 else 's'})"
    if report.microbatches > 1:
        what += f" in {report.microbatches} micro-batches"
    return f"{where} of each `Stacked`, {what}"


def raise_if_failed(report: VerifyReport) -> None:
    where = _slice_text(report)
    for name, (subject, against, scale, link) in _FAILURES.items():
        check = getattr(report, name)
        if check is None or check.passed:
            continue
        # (The loss's leaf is "loss", or "loss (streamed step)".)
        by = (
            f"{check.difference:.3g}, beyond the tolerance {check.tolerance:.3g} "
            f"(`atol + rtol * scale`, scale {check.scale:.3g}: {scale})"
        )
        raise DoesNotMatch(
            f"`verify`: {subject.format(check.leaf)} differs between the offloaded "
            f"step and {against} by {by}. Checked on {where}. {_UPSTREAM}"
            + link
            + f"\n{report}",
            report,
        )
