"""The search `plan` runs: compiles candidates (`memory_report`), never runs them,
and keeps what each compile showed; the steps of the search (the presets, single
moves and their combinations, a local search, the opted-in micro-batch counts and
compute dtypes) and the choice among the compiled candidates."""

import collections
import contextlib
import contextvars
import itertools
from collections.abc import Hashable, Iterator
from typing import Any, Literal

import jax
from jax.sharding import AbstractMesh

from .._checkpoint_name_log import UnusedName
from .._checkpoint_names import checkpoint_names, CheckpointName
from .._diagnose import DoesNotCompile
from .._report import (
    DoesNotFit,
    MemoryReport,
    size_text,
    time_text,
)
from . import _budget
from ._candidates import Candidate, field_of, Move, presets, Settings
from ._compile import CompilerCrashed, report, report_in_child
from ._progress import Progress
from ._table import PlanRow, PlanTable


# Single moves compiled, the largest by estimated bytes freed first; combinations
# of them compiled (fastest estimate first) until this many fit.
SINGLES = 6
COMBINATIONS = 3
COMBINATION_COMPILES = 12  # at most, whether they fit or not
# Then one knob at a time from the best so far, while it gets better.
IMPROVE_COMPILES = 6
# A change of the local search that moves less than this share of the device
# budget (by estimate) is not tried.
SMALLEST = 0.01


# Compiled candidates kept between searches in this process (`plan` again with other
# budgets, `fewest_chips` planning the target its probe found): the report, or
# what the compile raised, by step (the loss function and optimizer by identity, as
# `jax.jit` keys its cache), shapes, policy and target. The oldest go first.
KEPT = 256
_kept: collections.OrderedDict[Hashable, MemoryReport | Exception] = (
    collections.OrderedDict()
)
# And the checkpoint names a loss offers (one trace per name), by the loss and the
# shapes alone: `plan` again, or on another target, traces none of them again.
_names_kept: collections.OrderedDict[Hashable, tuple[CheckpointName, ...]] = (
    collections.OrderedDict()
)


def _keep(store: collections.OrderedDict, key: Hashable | None, make: Any) -> tuple:
    """`(store[key], True)` if this process has it, else `(make(), False)`, kept
    under `key` (unless it is `None`: not hashable) with the oldest of more than
    `KEPT` dropped."""
    if key is not None and key in store:
        store.move_to_end(key)
        return store[key], True
    value = make()
    if key is not None:
        store[key] = value
        while len(store) > KEPT:
            store.popitem(last=False)
    return value, False


class Fitted(Exception):
    """A candidate fits, and the search was only asked whether one does."""


_FIRST_FIT = contextvars.ContextVar("first_fit", default=False)


@contextlib.contextmanager
def first_fit() -> Iterator[None]:
    """Searches inside stop at the first candidate that fits (`Fitted`)."""
    token = _FIRST_FIT.set(True)
    try:
        yield
    finally:
        _FIRST_FIT.reset(token)


class Result:
    def __init__(self, candidate: Candidate, label: str):
        self.candidate = candidate
        self.label = label
        self.policy = candidate.policy()
        self.report: MemoryReport | None = None
        self.error: str | None = None
        self.required: int | None = None


class Search:
    """The candidates compiled for one step on one target, and the choice."""

    # Of every search in this process (`fewest_chips` counts its own): candidates
    # compiled, and how many of them an earlier search had compiled.
    compiles = 0
    reuses = 0

    def __init__(
        self,
        loss_fn: Any,
        optimizer: Any,
        model: Any,
        batch: tuple,
        target: str | None,
        mesh: AbstractMesh | None,
        has_aux: bool,
        progress: bool,
    ):
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.model, self.batch = model, batch
        self.target, self.mesh, self.has_aux = target, mesh, has_aux
        self.results: dict[Candidate, Result] = {}
        self.reused = 0  # of the results, compiled by an earlier search
        self.estimates: dict[Move, int] = {}  # bytes a move frees, before compiling
        self.parts: dict[str, tuple[str, ...]] = {}  # a field's parts placed apart
        self.pruned: dict[Candidate, tuple[str, str]] = {}
        self.budgets: tuple[int, int] = (0, 0)
        self.progress = Progress(progress)

    def evaluate(self, candidate: Candidate, label: str | None = None) -> Result:
        if candidate in self.results:
            return self.results[candidate]
        if label is not None and candidate.settings.label:
            label = f"{label}; {candidate.settings.label}"
        result = Result(candidate, label or candidate.label)
        try:
            report = self._compile(candidate, result)
        except DoesNotFit as e:
            result.required = e.required_bytes
            both = "host" in e.exceeded
            result.error = "too big for the device" + (" and host" if both else "")
        except DoesNotCompile as e:
            result.error = f"does not compile: {str(e).splitlines()[0][:80]}"
        except CompilerCrashed as e:
            result.error = f"compiler crashed: {e.last_line[-80:]}"
        except ValueError as e:
            if all(k == "device" for _, k in candidate.stream):
                raise
            # A streamed table the model reads otherwise than through `eo.embed`.
            result.error = f"does not trace: {str(e).splitlines()[0][:80]}"
        else:
            result.report = report
        self.results[candidate] = result
        Search.compiles += 1
        if _FIRST_FIT.get() and self.fits(candidate):
            self.progress.close()
            raise Fitted
        self.pruned.pop(candidate, None)
        self.progress.compiled()
        return result

    def _compile(self, candidate: Candidate, result: Result) -> MemoryReport:
        """The candidate's report. A name it saves or offloads that is not saved
        for the backward pass in this combination (its value is another name's,
        say) would do nothing: it is recomputed instead, and the label says so
        (what was asked of each such name, so that two candidates that compile
        alike keep labels of their own)."""
        asked = dict(candidate.residuals or ())
        label = result.label
        for _ in range(len(candidate.residuals or ()) + 1):
            policy = candidate.policy()
            try:
                return self._report(policy, candidate.microbatches)
            except UnusedName as e:
                if e.never_occurred or candidate.residuals is None:
                    raise
                residuals = tuple(
                    (n, "recompute" if n == e.pattern else c)
                    for n, c in candidate.residuals
                )
                candidate = candidate._replace(residuals=residuals)
                asked_for = ", ".join(
                    f"{'saving' if asked[n] == 'save' else 'offloading'} {n}"
                    for n, c in residuals
                    if c != asked[n]
                )
                first = label if label != result.candidate.label else candidate.label
                result.label = (
                    f"{first} ({asked_for} asked: not saved for the backward pass "
                    "in this combination)"
                )
                result.policy = candidate.policy()
        raise AssertionError("unreachable: every name recomputed compiles")

    def _key(self, *more: Hashable) -> Hashable | None:
        """The loss function (by identity, as `jax.jit` keys its cache), the model's
        and batch's structure and shapes, and `more`, as a key of what this process
        keeps; `None` if it cannot be hashed (a static field that is not)."""
        key = (
            self.loss_fn,
            self.has_aux,
            jax.tree.structure(self.model),
            tuple(jax.tree.leaves(self.model)),
            jax.tree.structure(self.batch),
            tuple(jax.tree.leaves(self.batch)),
            jax.dtypes.canonicalize_dtype(float),  # 64-bit or not
            *more,
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def names(self) -> tuple[CheckpointName, ...]:
        """`checkpoint_names(loss_fn, model, *batch)`, traced once in this process."""
        names, _ = _keep(
            _names_kept,
            self._key(),
            lambda: checkpoint_names(self.loss_fn, self.model, *self.batch),
        )
        return names

    def _report(self, policy: Any, microbatches: int) -> MemoryReport:
        """`memory_report` of the step under `policy`, or what it raised, compiled
        once in this process."""

        def compile_once():  # the report, or what the compile raised
            # The TPU compiler's remat to host can abort the process: in a child.
            here_or_child = report_in_child if policy.host_remat else report
            try:
                return here_or_child(
                    self.loss_fn,
                    self.optimizer,
                    self.model,
                    self.batch,
                    policy,
                    microbatches,
                    self.has_aux,
                    self.target,
                    self.mesh,
                )
            # `DoesNotFit`, `DoesNotCompile`, `UnusedName` and other refusals
            except (ValueError, CompilerCrashed) as e:
                return e

        key = self._key(
            self.optimizer, self.target, self.mesh, repr(policy), microbatches
        )
        outcome, reused = _keep(_kept, key, compile_once)
        if reused:
            Search.reuses += 1
            self.reused += 1
        if isinstance(outcome, Exception):
            raise outcome.with_traceback(None)
        return outcome

    def fits(self, candidate: Candidate) -> bool:
        r = self.results[candidate]
        device, host = self.budgets
        if r.report is None:
            return False
        return r.report.device_bytes <= device and r.report.host_bytes <= host

    def _seconds(self, candidate: Candidate) -> float:
        """The estimated step time (0 on the CPU backend, which has none: the
        smallest footprint is chosen there); infinite if not compiled."""
        r = self.results[candidate]
        if r.report is None:
            return float("inf")
        return 0.0 if r.report.time is None else r.report.time.seconds

    def _device(self, candidate: Candidate) -> float:
        r = self.results[candidate]
        if r.report is not None:
            return float(r.report.device_bytes)
        return float("inf") if r.required is None else float(r.required)

    def most(self, base: Candidate, names: tuple[str, ...], others: int) -> int:
        """The most compiles the search from `base` (which does not fit) makes:
        the presets, single moves, combinations and local search, and with
        `others` settings offered besides, those and a local search again."""
        n = 3 + min(SINGLES, len(base.moves(names))) + COMBINATION_COMPILES
        n += IMPROVE_COMPILES
        return n + (others + IMPROVE_COMPILES if others else 0)

    def presets(self, base: Candidate, names: tuple[str, ...]) -> None:
        """`Policy.remat()`, `Policy.offload_residuals()` and `Policy.offload_all()`
        (`base` is `Policy.none()`), in `base`'s settings."""
        with self.progress.stage(3):
            for label, candidate in presets(base, names):
                self.evaluate(candidate, label)

    def variants(self, candidate: Candidate, settings: list[Settings]) -> None:
        """`candidate` in each of the other settings offered (micro-batch counts,
        compute dtypes)."""
        with self.progress.stage(len(settings)):
            for s in settings:
                self.evaluate(candidate.with_settings(s))

    def combine(self, base: Candidate, names: tuple[str, ...]) -> None:
        """Compiles the single moves from `base` that free the most device memory
        (by estimate), then, taking each move's measured effect as additive,
        compiles the combinations estimated to fit, fastest estimate first, until
        `COMBINATIONS` of them fit."""
        moves = sorted(base.moves(names), key=lambda m: -self.estimates.get(m, 0))
        for move in moves[SINGLES:]:
            after = base.apply(move, names)
            self.pruned[after] = (
                after.label,
                f"pruned: frees {size_text(self.estimates.get(move, 0))} by "
                f"estimate, less than the {SINGLES} moves tried",
            )
        effects: list[tuple[Move, float, float, float]] = []
        with self.progress.stage(min(SINGLES, len(moves))):
            for move in moves[:SINGLES]:
                single = base.apply(move, names)
                self.evaluate(single)
                freed = self._device(base) - self._device(single)
                if 0 < freed < float("inf"):
                    effects.append((move, freed, *self._added(base, single, move)))
        device_budget, host_budget = self.budgets
        options = []
        for n in range(2, len(effects) + 1):
            for chosen in itertools.combinations(effects, n):
                touched = [(m.knob, m.name) for m, *_ in chosen]
                if len(set(touched)) < len(touched):
                    continue  # one name offloaded and recomputed
                device = self._device(base) - sum(c[1] for c in chosen)
                host = self._host(base) + sum(c[3] for c in chosen)
                if device <= device_budget and host <= host_budget:
                    seconds = self._seconds(base) + sum(c[2] for c in chosen)
                    options.append((seconds, host, [c[0] for c in chosen]))
        # Fastest first; where `base` has no step time (too big to compile), in
        # the order listed: the moves freeing the most device memory first.
        options.sort(key=lambda o: o[0])
        most = min(len(options), COMBINATION_COMPILES)
        with self.progress.stage(most, planned=COMBINATION_COMPILES):
            self._combinations(base, names, options)

    def _combinations(
        self, base: Candidate, names: tuple[str, ...], options: list
    ) -> None:
        fitted = compiled = 0
        for seconds, _, chosen in options:
            candidate = base
            for move in chosen:
                candidate = candidate.apply(move, names)
            if candidate in self.results:
                continue
            if fitted >= COMBINATIONS or compiled >= COMBINATION_COMPILES:
                why = (
                    f"in {time_text(seconds)}: slower than the combinations compiled"
                    if seconds < float("inf")
                    else "after the combinations compiled (no step time to rank by: "
                    "the step without moves is too big to compile)"
                )
                self.pruned[candidate] = (
                    candidate.label,
                    f"pruned: estimated to fit, {why}",
                )
                continue
            self.evaluate(candidate)
            compiled += 1
            fitted += self.fits(candidate)

    def improve(self, names: tuple[str, ...]) -> None:
        """A local search from the best candidate compiled so far (the fastest that
        fits, else the one over its budgets by the least): turns one knob at a
        time, the changes estimated to help first, and moves there if the compile
        is better (fits and is faster, or is over its budgets by less). Of a
        fitting candidate it tries what moves bytes back to the device within the
        budgets (less host traffic); of one over a budget, what brings it closer.
        At most `IMPROVE_COMPILES` compiles."""
        with self.progress.stage(IMPROVE_COMPILES):
            self._improve(names)

    def _improve(self, names: tuple[str, ...]) -> None:
        current = self.best()
        compiled = 0
        while current is not None and compiled < IMPROVE_COMPILES:
            report = self.results[current].report
            assert report is not None
            fits = self.fits(current)
            if fits and report.time is None:
                return  # no step time to improve (the CPU backend)
            before = self._overflow(report.device_bytes, report.host_bytes)
            options = []
            for move in current.flips(self.parts):
                device, host = self._after(current, move, report)
                moved = max(
                    abs(device - report.device_bytes) / self.budgets[0],
                    abs(host - report.host_bytes) / max(self.budgets[1], 1),
                )
                if moved < SMALLEST:
                    continue  # a part too small to matter (a norm's scale)
                if fits and device > report.device_bytes:
                    if self._overflow(device, host) == 0:
                        options.append((report.device_bytes - device, move))
                elif not fits and self._overflow(device, host) < before:
                    options.append((self._overflow(device, host), move))
            options.sort(key=lambda o: o[0])
            following = None
            for _, move in options:
                candidate = current.apply(move, names)
                if candidate in self.results or compiled >= IMPROVE_COMPILES:
                    continue
                self.evaluate(candidate)
                compiled += 1
                if self._better(candidate, current):
                    following = candidate
                    break
            current = following

    def best(self) -> Candidate | None:
        compiled = [c for c, r in self.results.items() if r.report is not None]
        fitting = [c for c in compiled if self.fits(c)]
        if fitting:
            return min(fitting, key=self._rank)
        if not compiled:
            return None
        return min(compiled, key=self._over)

    def _better(self, a: Candidate, b: Candidate) -> bool:
        if self.fits(a):
            return not self.fits(b) or self._rank(a) < self._rank(b)
        return (
            not self.fits(b)
            and self.results[a].report is not None
            and self._over(a) < self._over(b)
        )

    def _rank(self, candidate: Candidate) -> tuple[float, float]:
        """Faster first; of equal times, the smaller device footprint."""
        return self._seconds(candidate), self._device(candidate)

    def _over(self, candidate: Candidate) -> float:
        report = self.results[candidate].report
        assert report is not None
        return self._overflow(report.device_bytes, report.host_bytes)

    def _overflow(self, device: int | float, host: int | float) -> float:
        """How far over the budgets, as fractions of them (0: fits)."""
        device_budget, host_budget = self.budgets
        return max(device - device_budget, 0) / device_budget + max(
            host - host_budget, 0
        ) / max(host_budget, 1)

    def _after(
        self, candidate: Candidate, move: Move, report: MemoryReport
    ) -> tuple[float, float]:
        """The device and host bytes after `move`, by estimate: a field's or a
        state part's bytes change sides; a checkpoint name's saved bytes are on
        the device when saved, on the host when offloaded, nowhere recomputed."""
        device, host = float(report.device_bytes), float(report.host_bytes)
        if move.knob != "residual":
            n = self.estimates.get(Move(move.knob, move.name, "pinned_host"), 0)
            # Its parts already on that side, placed apart, do not move.
            placed = dict(getattr(candidate, move.knob))
            n -= sum(
                self.estimates.get(Move(move.knob, part, "pinned_host"), 0)
                for part in self.parts.get(move.name, ())
                if placed.get(part) == move.to
            )
            sign = 1 if move.to == "device" else -1
            field = field_of(move.name)
            copied = dict(candidate.copies).get(field) == "pinned_host"
            if move.knob == "params" and copied and candidate.settings.compute_dtype:
                # Their compute copies go to the host with them (or vanish).
                copies = self.estimates.get(Move("copies", field, "pinned_host"), 0)
                whole = self.estimates.get(Move("params", field, "pinned_host"), 1)
                return device + sign * n, host - sign * n * (1 + copies / whole)
            return device + sign * n, host - sign * n
        n = self.estimates.get(Move("residual", move.name, "offload"), 0)
        side = {"save": (1, 0), "offload": (0, 1), "recompute": (0, 0)}
        now = dict(candidate.residuals or ())[move.name]
        return (
            device + (side[move.to][0] - side[now][0]) * n,
            host + (side[move.to][1] - side[now][1]) * n,
        )

    def _added(
        self, base: Candidate, single: Candidate, move: Move
    ) -> tuple[float, float]:
        """The step time and host bytes a single move adds to `base`. Of a move
        whose step the compiler found too big (no report, no time), the time is
        taken as unchanged, and the host bytes as the estimate's (a field's
        parameters or state): the combinations' compiles give the real figures."""
        if (
            self.results[single].report is not None
            and self.results[base].report is not None
        ):
            added = self._seconds(single) - self._seconds(base)
            return added, self._host(single) - self._host(base)
        host = self.estimates.get(move, 0) if move.knob != "residual" else 0
        if move.knob == "residual" and move.to == "offload":
            host = self.estimates.get(move, 0)
        return 0.0, float(host)

    def _host(self, candidate: Candidate) -> float:
        r = self.results[candidate]
        return 0.0 if r.report is None else float(r.report.host_bytes)

    def finish(self) -> tuple[Result, PlanTable]:
        """The chosen candidate's result, and the table of every candidate."""
        device, host = self.budgets
        chosen = self.best()
        if chosen is not None and not self.fits(chosen):
            chosen = None
        none_flops = self._flops(next(iter(self.results)))
        rows = []
        for c, r in self.results.items():
            rep = r.report
            t = None if rep is None else rep.time
            status = "chosen" if c == chosen else (r.error or "compiled")
            rows.append(
                PlanRow(
                    r.label,
                    r.policy,
                    status,
                    device_bytes=rep.device_bytes if rep is not None else r.required,
                    host_bytes=None if rep is None else rep.host_bytes,
                    fits=None if rep is None else self.fits(c),
                    seconds=None if t is None else t.seconds,
                    bound=None if t is None else t.bound,
                    transfer_bytes=None
                    if rep is None
                    else rep.host_to_device_bytes + rep.device_to_host_bytes,
                    recomputed_flops=None
                    if t is None or none_flops is None
                    else max(t.flops - none_flops, 0.0),
                )
            )
        rows += [
            PlanRow(label, c.policy(), why) for c, (label, why) in self.pruned.items()
        ]
        self.progress.close()
        table = PlanTable(tuple(rows), device, host)
        if chosen is None:
            error = self._nothing_fits(device, host)
            error.tried = table
            raise error
        return self.results[chosen], table

    def _flops(self, candidate: Candidate) -> float | None:
        r = self.results[candidate]
        t = None if r.report is None else r.report.time
        return None if t is None else t.flops

    def _nothing_fits(self, device: int, host: int) -> DoesNotFit:
        """The error when no candidate fits, about the nearest miss: of the
        compiled candidates that fit the device, the one with the smallest host
        footprint (the host budget broke); else the smallest device footprint."""
        on_device = [
            c
            for c, r in self.results.items()
            if r.report is not None and r.report.device_bytes <= device
        ]
        if on_device:
            nearest = min(on_device, key=self._host)
        else:
            nearest = min(self.results, key=self._device)
        r = self.results[nearest]
        need = self._device(nearest)
        host_need = None if r.report is None else r.report.host_bytes
        over_host = host_need is not None and host_need > host
        exceeded: tuple[Literal["device", "host"], ...] = (
            ("host",) if on_device else ("device",)
        )
        if not on_device and over_host:
            exceeded = ("device", "host")
        shown = "unknown" if need == float("inf") else size_text(int(need))
        if on_device:
            what = (
                "the smallest host footprint of the candidates that fit the "
                f"device is {size_text(host_need or 0)} ({r.label})"
            )
        else:
            what = f"the smallest device footprint found is {shown} ({r.label})"
            what += (
                f"; its host footprint is {size_text(host_need)}" if host_need else ""
            )
        budgets = "budgets" if len(exceeded) > 1 else "budget"
        message = (
            f"`plan`: no candidate fits the budgets ({size_text(device)} of device "
            f"memory, {size_text(host)} of host memory per device): {what}, over the "
            f"{' and '.join(exceeded)} {budgets}. Give {_budget.fixes(exceeded)}, or "
            "more devices."
        )
        return DoesNotFit(
            message,
            target=self.target or jax.default_backend(),
            compiler_message="",
            arguments={},
            sizes=(int(need) if need != float("inf") else 0, device),
            host_sizes=(host_need, host),
            exceeded=exceeded,
        )
