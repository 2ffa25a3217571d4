"""The search `plan` runs. It compiles candidates (`memory_report`), never runs
them, and keeps what each compile showed. Its steps: the presets, single moves and
their combinations, a local search, the opted-in micro-batch counts and compute
dtypes. The search goes by the raw estimates; the choice among the compiled
candidates that fit is made within the estimates' error (`_choice`), by
`_outcome`."""

import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from .._checkpoint_name_log import UnusedName
from .._diagnose import DoesNotCompile
from .._policy import Policy
from .._report import DoesNotFit, MemoryReport, size_text, time_text
from ._candidates import Candidate, Move, Part, Settings
from ._compile import CACHE, Cache, CompilerCrashed, Task
from ._progress import Progress


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

_T = TypeVar("_T")


@dataclasses.dataclass
class Result:
    """What compiling a candidate showed: its `report`, or why there is none
    (`error`; `required`: the device bytes the compiler asked for). Its `label`
    and `policy` change where a name it saves is recomputed instead."""

    candidate: Candidate
    label: str
    policy: Policy
    report: MemoryReport | None = None
    error: str | None = None
    required: int | None = None


# One combination of single moves estimated to fit, and its step time.
_Option = tuple[float, list[Move]]
# A single move compiled: the device bytes it frees, the time and host bytes it adds.
_Effect = tuple[Move, float, float, float]


@dataclasses.dataclass
class Search:
    """The candidates compiled for one task, and what each showed (the choice among
    them is `_outcome.choose`).

    - `task`: what is compiled; `budgets`: device and host bytes per device.
    - `progress`: the bar; `cache`: what the searches of a process share.
    - `first_fit`: stop at the first candidate that fits (`stopped`).
    - `margin`: the device bytes left free under the device budget (the first of
        `budgets` is the budget less it).
    - `start`: when the planning began (`time.perf_counter()`).
    - `interrupted`: stopped by Ctrl-C (`KeyboardInterrupt`).
    - `results`: each candidate compiled; `reused`: how many of them an earlier
        search compiled; `pruned`: those left out, with why.
    - `estimates`: the device bytes a move frees, before compiling; `parts`: the
        parts of a field (or of its state slot) that can be placed apart.
    - `counts`: the micro-batch counts searched (`plan(microbatches="search")`),
        ascending; none when the counts offered are each compiled as given.
        `sized`: each candidate evaluated, its count the hint, -> the same
        placement with the fewest micro-batches that fit (`_fewest`).
    """

    task: Task
    budgets: tuple[int, int]
    progress: Progress = dataclasses.field(default_factory=lambda: Progress(False))
    first_fit: bool = False
    margin: int = 0
    start: float = dataclasses.field(default_factory=time.perf_counter)
    cache: Cache = dataclasses.field(default_factory=lambda: CACHE)
    results: dict[Candidate, Result] = dataclasses.field(default_factory=dict)
    reused: int = 0
    pruned: dict[Candidate, str] = dataclasses.field(default_factory=dict)
    estimates: dict[Move, int] = dataclasses.field(default_factory=dict)
    parts: dict[Part, tuple[Part, ...]] = dataclasses.field(default_factory=dict)
    counts: tuple[int, ...] = ()
    sized: dict[Candidate, Candidate] = dataclasses.field(default_factory=dict)
    stopped: bool = False
    interrupted: bool = False

    def evaluate(self, candidate: Candidate, label: str | None = None) -> Result:
        """Compiles `candidate`, once; searching the micro-batch counts (`counts`),
        its placement with the fewest that fit (`_fewest`). The result's
        `candidate` is the one chosen. With `first_fit`, one that fits stops the
        search."""
        if not self.counts:
            return self._evaluate(candidate, label)
        if candidate not in self.sized:
            fewest = self._fewest(candidate, label)
            self.sized[candidate] = self.sized.setdefault(fewest, fewest)
        return self.results[self.sized[candidate]]

    def known(self, candidate: Candidate) -> bool:
        """Whether `candidate` was evaluated (or compiled in another's search)."""
        return candidate in self.results or candidate in self.sized

    def _fewest(self, candidate: Candidate, label: str | None) -> Candidate:
        """`candidate`'s placement with the fewest micro-batches (of `counts`) that
        fit the device budget, by compiling: its own count first, then, where
        that fits, the next fewer, and then bisected (device memory falls as the
        count grows). Where none fits, the most; where a compile fails for
        another reason than memory, that one."""
        counts = self.counts
        low, high = -1, len(counts)  # over the device budget at `low`, within at `high`
        i = counts.index(candidate.settings.microbatches)
        while high - low > 1:
            at = candidate.with_settings(microbatches=counts[i])
            result = self._evaluate(at, label)
            if result.report is None and result.required is None:
                return at  # does not compile: no count helps
            r = result.report
            within = r is not None and r.device_bytes <= self.budgets[0]
            first = (low, high) == (-1, len(counts))
            low, high = (low, i) if within else (i, high)
            i = high - 1 if first and within else (low + high) // 2
            if self.stopped:
                break
        kept = counts[high] if high < len(counts) else counts[low]
        return candidate.with_settings(microbatches=kept)

    def _evaluate(self, candidate: Candidate, label: str | None = None) -> Result:
        """Compiles `candidate` (in its own micro-batch count), once."""
        if candidate in self.results:
            return self.results[candidate]
        if label is not None and candidate.settings.label:
            label = f"{label}; {candidate.settings.label}"
        result = Result(candidate, label or candidate.label, candidate.policy())
        self._fill(result)
        self.results[candidate] = result
        if self.first_fit and self.fits(candidate):
            self.stopped = True
            self.progress.close()
        else:
            self.pruned.pop(candidate, None)
            self.progress.compiled()
        return result

    def until_stopped(self, items: Iterable[_T]) -> Iterator[_T]:
        """`items`, one by one, while the search goes on (not `stopped`)."""
        return itertools.takewhile(lambda _: not self.stopped, items)

    def _fill(self, result: Result) -> None:
        """The result's report, or why there is none."""
        candidate = result.candidate
        try:
            result.report = self._compile(candidate, result)
        except DoesNotFit as e:
            result.required = e.required_bytes
            both = "host" in e.exceeded
            result.error = "too big for the device" + (" and host" if both else "")
        except DoesNotCompile as e:
            result.error = f"does not compile: {str(e).splitlines()[0][:80]}"
        except CompilerCrashed as e:
            result.error = f"compiler crashed: {e.last_line[-80:]}"
        except ValueError as e:
            if all(k == "device" for k in candidate.host_tables.values()):
                raise
            # A streamed table the model reads otherwise than through `eo.embed`.
            result.error = f"does not trace: {str(e).splitlines()[0][:80]}"

    def _compile(self, candidate: Candidate, result: Result) -> MemoryReport:
        """The candidate's report. A name it saves or offloads that is not saved
        for the backward pass in this combination (its value is another name's,
        say) would do nothing: it is recomputed instead. The label says what was
        asked of each such name, so that two candidates that compile alike keep
        labels of their own."""
        asked = dict(candidate.residuals or {})
        label = result.label
        for _ in range(len(asked) + 1):
            try:
                return self._report(candidate.policy(), candidate.settings.microbatches)
            except UnusedName as e:
                if e.never_occurred or candidate.residuals is None:
                    raise
                residuals = candidate.residuals.set(e.pattern, "recompute")
                candidate = candidate._replace(residuals=residuals)
                asked_for = ", ".join(
                    f"{'saving' if asked[n] == 'save' else 'offloading'} {n}"
                    for n, c in residuals.items()
                    if c != asked[n]
                )
                first = label if label != result.candidate.label else candidate.label
                result.label = (
                    f"{first} ({asked_for} asked: not saved for the backward pass "
                    "in this combination)"
                )
                result.policy = candidate.policy()
        raise AssertionError("unreachable: every name recomputed compiles")

    def _report(self, policy: Policy, microbatches: int) -> MemoryReport:
        """`memory_report` of the step under `policy` (or what it raised), compiled
        once in this process."""
        outcome, reused = self.cache.report(self.task, policy, microbatches)
        self.reused += reused
        if isinstance(outcome, Exception):
            raise outcome.with_traceback(None)
        return outcome

    def fits(self, candidate: Candidate) -> bool:
        r = self.results[candidate].report
        return r is not None and self._overflow(r.device_bytes, r.host_bytes) == 0

    def seconds(self, candidate: Candidate) -> float:
        """The estimated step time: 0 on the CPU backend, which has none (the
        smallest footprint is chosen there); infinite if not compiled."""
        r = self.results[candidate]
        if r.report is None:
            return float("inf")
        return 0.0 if r.report.time is None else r.report.time.seconds

    def device(self, candidate: Candidate) -> float:
        r = self.results[candidate]
        if r.report is not None:
            return float(r.report.device_bytes)
        return float("inf") if r.required is None else float(r.required)

    def host(self, candidate: Candidate) -> float:
        r = self.results[candidate]
        return 0.0 if r.report is None else float(r.report.host_bytes)

    def most(
        self, base: Candidate, names: tuple[str, ...], settings: Sequence[Settings]
    ) -> int:
        """The most compiles the search from `base` (which does not fit) makes:
        the presets, single moves, combinations and local search; and with other
        `settings` offered besides, those and a local search again. Searching the
        micro-batch counts, twice that (a placement's count and the one below)."""
        presets = 3 + sum(s.compute_dtype is not None for s in settings)
        n = presets + min(SINGLES, len(base.moves(names))) + COMBINATION_COMPILES
        others = len(settings) - 1
        n += IMPROVE_COMPILES + (others + IMPROVE_COMPILES if others else 0)
        return n * (2 if len(self.counts) > 1 else 1)

    def compile_each(self, candidates: Sequence[tuple[str | None, Candidate]]) -> None:
        """A stage that compiles each of `candidates`, with its label (`None`: its
        own): `Policy`'s presets (`_candidates.presets`), or a candidate in the
        other settings offered."""
        with self.progress.stage(len(candidates)):
            for label, candidate in self.until_stopped(candidates):
                self.evaluate(candidate, label)

    def combine(self, base: Candidate, names: tuple[str, ...]) -> None:
        """Compiles the single moves from `base` that free the most device memory
        (by estimate). Taking each move's measured effect as additive, it then
        compiles the combinations estimated to fit, fastest estimate first, until
        `COMBINATIONS` of them fit."""
        moves = sorted(base.moves(names), key=lambda m: -self.estimates.get(m, 0))
        for move in moves[SINGLES:]:
            freed = size_text(self.estimates.get(move, 0))
            why = f"frees {freed} by estimate, less than the {SINGLES} moves tried"
            self.pruned[base.apply(move, names)] = f"pruned: {why}"
        effects: list[_Effect] = []
        with self.progress.stage(min(SINGLES, len(moves))):
            for move in self.until_stopped(moves[:SINGLES]):
                single = base.apply(move, names)
                self.evaluate(single)
                freed = self.device(base) - self.device(single)
                if 0 < freed < float("inf"):
                    effects.append((move, freed, *self._added(base, single, move)))
        options = self._options(base, effects)
        most = min(len(options), COMBINATION_COMPILES)
        fitted = compiled = 0
        with self.progress.stage(most, planned=COMBINATION_COMPILES):
            for seconds, chosen in self.until_stopped(options):
                candidate = base
                for move in chosen:
                    candidate = candidate.apply(move, names)
                if self.known(candidate):
                    continue
                if fitted < COMBINATIONS and compiled < COMBINATION_COMPILES:
                    compiled += 1
                    fitted += self.fits(self.evaluate(candidate).candidate)
                    continue
                why = (
                    f"in {time_text(seconds)}: slower than the combinations compiled"
                    if seconds < float("inf")
                    else "after the combinations compiled (no step time to rank by: "
                    "the step without moves is too big to compile)"
                )
                self.pruned[candidate] = f"pruned: estimated to fit, {why}"

    def _options(self, base: Candidate, effects: list[_Effect]) -> list[_Option]:
        """The combinations of two or more single moves (`effects`: each with the
        device bytes it frees, the time and host bytes it adds) estimated to fit.
        Fastest first; where `base` has no step time (too big to compile), in the
        order listed: the moves freeing the most device memory first."""
        options = []
        for n in range(2, len(effects) + 1):
            for chosen in itertools.combinations(effects, n):
                touched = [(m.knob, m.name) for m, *_ in chosen]
                if len(set(touched)) < len(touched):
                    continue  # one name offloaded and recomputed
                device = self.device(base) - sum(c[1] for c in chosen)
                host = self.host(base) + sum(c[3] for c in chosen)
                if self._overflow(device, host) == 0:
                    seconds = self.seconds(base) + sum(c[2] for c in chosen)
                    options.append((seconds, [c[0] for c in chosen]))
        return sorted(options, key=lambda o: o[0])

    def improve(self, names: tuple[str, ...]) -> None:
        """A local search from the best candidate compiled so far: the fastest that
        fits, else the one over its budgets by the least. It turns one knob at a
        time, the changes estimated to help first, and moves there if the compile
        is better: fits and is faster, or is over its budgets by less. Of a fitting
        candidate it tries what moves bytes back to the device within the budgets
        (less host traffic); of one over a budget, what brings it closer. At most
        `IMPROVE_COMPILES` compiles."""
        current, compiled = self.best(), 0
        with self.progress.stage(IMPROVE_COMPILES):
            while current is not None and compiled < IMPROVE_COMPILES:
                report = self.results[current].report
                assert report is not None
                if self.fits(current) and report.time is None:
                    return  # no step time to improve (the CPU backend)
                following = None
                for move in self.until_stopped(self._flips(current, report)):
                    candidate = current.apply(move, names)
                    if self.known(candidate) or compiled >= IMPROVE_COMPILES:
                        continue
                    candidate = self.evaluate(candidate).candidate
                    compiled += 1
                    if self.order(candidate) < self.order(current):
                        following = candidate
                        break
                current = following

    def _flips(self, current: Candidate, report: MemoryReport) -> list[Move]:
        """The local search's changes from `current`, the most promising first:
        of a fitting candidate, those that move bytes back to the device within
        the budgets (the most first); of one over a budget, those estimated to
        bring it closer (the closest first)."""
        fits = self.fits(current)
        was = (report.device_bytes, report.host_bytes)
        before = self._overflow(*was)
        options = []
        for move in current.flips(self.parts):
            device, host = self._after(current, move, report)
            sides = zip((device, host), was, self.budgets)
            if max(abs(n - w) / max(b, 1) for n, w, b in sides) < SMALLEST:
                continue  # a part too small to matter (a norm's scale)
            if fits and device > report.device_bytes:
                if self._overflow(device, host) == 0:
                    options.append((report.device_bytes - device, move))
            elif not fits and self._overflow(device, host) < before:
                options.append((self._overflow(device, host), move))
        return [move for _, move in sorted(options, key=lambda o: o[0])]

    def choices(self) -> list[Candidate]:
        """The compiled candidates the plan may be: searching the micro-batch
        counts, each placement in the fewest that fit (`sized`), not the other
        counts compiled to find them (all, before the first search of them ends:
        Ctrl-C)."""
        kept = set(self.sized.values()) if self.sized else self.results
        return [c for c in self.results if c in kept]

    def fastest(self) -> list[Candidate]:
        """The compiled candidates that fit, the fastest by estimate first."""
        return sorted(filter(self.fits, self.choices()), key=self.rank)

    def best(self) -> Candidate | None:
        """The fastest candidate that fits by estimate (where the search goes on
        from), else the one over its budgets by the least (`order`); `None` if
        none compiled."""
        compiled = [c for c in self.choices() if self.results[c].report is not None]
        return min(compiled, key=self.order, default=None)

    def order(self, candidate: Candidate) -> tuple[bool, float, float]:
        """Better first: those that fit, by `rank`; then the others, over their
        budgets by the least first (not compiled: last)."""
        if (report := self.results[candidate].report) is None:
            return True, float("inf"), 0.0
        if self.fits(candidate):
            return (False, *self.rank(candidate))
        return True, self._overflow(report.device_bytes, report.host_bytes), 0.0

    def error(self, candidate: Candidate) -> float:
        """How far the candidate's estimate can be off, relative."""
        report = self.results[candidate].report
        return 0.0 if report is None or report.time is None else report.time.error

    def rank(self, candidate: Candidate) -> tuple[float, float]:
        """Faster first; of equal times, the smaller device footprint."""
        return self.seconds(candidate), self.device(candidate)

    def _overflow(self, device: int | float, host: int | float) -> float:
        """How far over the budgets, as fractions of them (0: fits)."""
        over = zip((device, host), self.budgets)
        return sum(max(n - budget, 0) / max(budget, 1) for n, budget in over)

    def _after(
        self, candidate: Candidate, move: Move, report: MemoryReport
    ) -> tuple[float, float]:
        """The device and host bytes after `move`, by estimate: a field's or a
        state part's bytes change sides; a checkpoint name's saved bytes are on
        the device when saved, on the host when offloaded, nowhere recomputed."""
        device, host = float(report.device_bytes), float(report.host_bytes)
        if move.knob == "residual":
            assert isinstance(move.name, str)
            n = self.estimates.get(Move("residual", move.name, "offload"), 0)
            now = (candidate.residuals or {})[move.name]
            device += n * ((move.to == "save") - (now == "save"))
            return device, host + n * ((move.to == "offload") - (now == "offload"))
        n = self.estimates.get(move._replace(to="pinned_host"), 0)
        # Its parts already on that side, placed apart, do not move.
        placed = getattr(candidate, move.knob)
        parts = self.parts.get(move.name, ()) if isinstance(move.name, Part) else ()
        n -= sum(
            self.estimates.get(Move(move.knob, part, "pinned_host"), 0)
            for part in parts
            if placed.get(part) == move.to
        )
        sign = 1 if move.to == "device" else -1
        share = 1.0  # of the bytes to the device that leave the host
        if (
            isinstance(move.name, Part)
            and move.knob == "params"
            and candidate.copies.get(move.name.field) == "pinned_host"
            and candidate.settings.compute_dtype
        ):
            # Their compute copies go to the host with them (or vanish).
            field = move.name.field
            copies = self.estimates.get(Move("copies", field, "pinned_host"), 0)
            whole = self.estimates.get(Move("params", Part(field), "pinned_host"), 1)
            share += copies / whole
        return device + sign * n, host - sign * n * share

    def _added(
        self, base: Candidate, single: Candidate, move: Move
    ) -> tuple[float, float]:
        """The step time and host bytes a single move adds to `base`. Of a move
        whose step the compiler found too big (no report, no time), the time is
        taken as unchanged, and the host bytes as the estimate's (a field's
        parameters or state): the combinations' compiles give the real figures."""
        if all(self.results[c].report is not None for c in (base, single)):
            added = self.seconds(single) - self.seconds(base)
            return added, self.host(single) - self.host(base)
        to_host = move.knob != "residual" or move.to == "offload"
        return 0.0, float(self.estimates.get(move, 0) if to_host else 0)
