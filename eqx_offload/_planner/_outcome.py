"""What a search found: the choice among the compiled candidates that fit (within
the estimates' error, `_choice`) and why it was made, the table of every candidate
considered, and the `Plan` of the choice; or, where none fits, the error about the
nearest miss."""

import time
from typing import Literal, TYPE_CHECKING

import jax

from .._errors import see
from .._report import DoesNotFit, size_text, time_text
from . import _budget, _choice, _rates
from ._candidates import Candidate
from ._plan_type import batch_size, Plan
from ._table import PlanRow, PlanTable


if TYPE_CHECKING:  # types only (`_search` is one level below)
    from ._search import Search


def choose(search: "Search") -> tuple[Candidate | None, list[Candidate]]:
    """The candidate `plan` chooses (`_choice.choose`), and those tied with the
    fastest (`_choice.tied`); `None` and none if nothing fits."""
    fitting = list(filter(search.fits, search.choices()))
    if not fitting:
        return None, []
    options = [
        _choice.Option(
            search.seconds(c),
            search.error(c),
            search.budgets[0] - search.device(c),
            c.settings.experimental,
        )
        for c in fitting
    ]
    tied = [fitting[i] for i in _choice.tied(options)]
    enough = _choice.ENOUGH_HEADROOM * search.budgets[0]
    return fitting[_choice.choose(options, enough)], tied


def finish(search: "Search") -> Plan | DoesNotFit:
    """The `Plan` of the chosen candidate, with the table of every candidate; or,
    where none fits, the error about the nearest miss (`e.tried`: the table)."""
    chosen, tied = choose(search)
    # (`Policy.none()`'s, the first compiled)
    none = search.results[next(iter(search.results))].report
    none_flops = None if none is None or none.time is None else none.time.flops
    kept = set(search.choices())

    def row(c: Candidate) -> PlanRow:
        """The table's row of a compiled candidate: chosen; kept (one the plan
        may be, not a micro-batch count compiled to find a placement's fewest);
        tied."""
        r = search.results[c]
        compiled = "compiled" if c in kept else "micro-batch probe"
        status = "chosen" if c == chosen else (r.error or compiled)
        if r.report is None:
            return PlanRow(r.label, r.policy, status, device_bytes=r.required)
        rep, t = r.report, r.report.time
        return PlanRow(
            r.label,
            r.policy,
            status,
            device_bytes=rep.device_bytes,
            host_bytes=rep.host_bytes,
            fits=search.fits(c),
            seconds=None if t is None else t.seconds,
            bound=None if t is None else t.bound,
            transfer_bytes=rep.host_to_device_bytes + rep.device_to_host_bytes,
            recomputed_flops=None
            if t is None or none_flops is None
            else max(t.flops - none_flops, 0.0),
            error=None if t is None else t.error,
            kind=None if t is None else t.kind,
            rates=() if t is None else _rates.used(t),
            tied=c in tied if search.fits(c) and t is not None else None,
            microbatches=c.settings.microbatches,
            compute_bound_seconds=getattr(t, "compute_bound_seconds", None),
            mfu=getattr(t, "mfu", None),
        )

    rows = [row(c) for c in search.results]
    rows += [PlanRow(c.label, c.policy(), why) for c, why in search.pruned.items()]
    search.progress.close()
    decision = "" if chosen is None else _decision(search, chosen, tied)
    table = PlanTable(
        tuple(rows), *search.budgets, search.margin, decision, search.interrupted
    )
    if chosen is None:
        error = _nothing_fits(search)
        error.tried = table
        return error
    result, task = search.results[chosen], search.task
    assert result.report is not None
    return Plan(
        result.policy,
        result.report,
        table,
        compiled=len(search.results),
        reused=search.reused,
        seconds=time.perf_counter() - search.start,
        loss_fn=task.loss_fn,
        optimizer=task.optimizer,
        has_aux=task.has_aux,
        microbatches=chosen.settings.microbatches,
        target=task.target,
        mesh=task.mesh,
        interrupted=search.interrupted,
        examples=batch_size(task.batch)[0],
        sequence=batch_size(task.batch)[1],
    )


def _decision(search: "Search", chosen: Candidate, tied: list[Candidate]) -> str:
    """Why the chosen candidate was chosen, where it is not simply the fastest
    by estimate."""
    fastest = min(tied, key=search.rank)
    if chosen == fastest or search.seconds(fastest) <= 0:
        return ""
    error = max(search.error(fastest), search.error(chosen))
    slower = search.seconds(chosen) / search.seconds(fastest) - 1
    free = [search.budgets[0] - search.device(c) for c in (chosen, fastest)]
    if fastest.settings.experimental and not chosen.settings.experimental:
        why = f"it uses no experimental stage ({fastest.settings.label} does)"
    else:
        why = (
            f"it leaves {size_text(int(free[0]))} of device memory free where "
            f"the fastest leaves {size_text(int(free[1]))}, less than "
            f"{_choice.ENOUGH_HEADROOM:.0%} of the budget"
        )
    report = search.results[chosen].report
    assert report is not None and report.time is not None
    origin = report.time.hardware.label("error")
    return (
        f"Chosen within the estimates' error: it is estimated {slower:.0%} "
        f"slower than the fastest ({search.results[fastest].label}: "
        f"{time_text(search.seconds(fastest))}), within their ±{error:.0%} error "
        f"({origin}); of the {len(tied)} candidates that close, {why}."
    )


def _nothing_fits(search: "Search") -> DoesNotFit:
    """The error when no candidate fits, about the nearest miss: of the
    compiled candidates that fit the device, the one with the smallest host
    footprint (the host budget broke); else the smallest device footprint."""
    device, host = search.budgets
    on_device = [
        c
        for c in search.choices()
        if (r := search.results[c].report) is not None and r.device_bytes <= device
    ]
    if on_device:
        nearest = min(on_device, key=search.host)
    else:
        nearest = min(search.choices(), key=search.device)
    r = search.results[nearest]
    need = search.device(nearest)
    host_need = None if r.report is None else r.report.host_bytes
    exceeded: tuple[Literal["device", "host"], ...] = ("host",)
    what = (
        "the smallest host footprint of the candidates that fit the "
        f"device is {size_text(host_need or 0)} ({r.label})"
    )
    if not on_device:
        over_host = host_need is not None and host_need > host
        exceeded = ("device", "host") if over_host else ("device",)
        shown = "unknown" if need == float("inf") else size_text(int(need))
        what = f"the smallest device footprint found is {shown} ({r.label})"
        what += f"; its host footprint is {size_text(host_need)}" if host_need else ""
    budgets = "budgets" if len(exceeded) > 1 else "budget"
    fix = _budget.fixes(exceeded, searched=bool(search.counts))
    message = (
        f"`plan`: no candidate fits the budgets ({size_text(device)} of device "
        f"memory, {size_text(host)} of host memory per device): {what}, over the "
        f"{' and '.join(exceeded)} {budgets}. Give {fix}, or "
        "more devices." + see(115)
    )
    return DoesNotFit(
        message,
        target=search.task.target or jax.default_backend(),
        sizes=(int(need) if need != float("inf") else 0, device),
        host_sizes=(host_need, host),
        exceeded=exceeded,
    )
