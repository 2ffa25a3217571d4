"""Replaying a compiled program's schedule with a clock: how long each instruction,
transfer and host computation takes on a `Hardware`, and what the device waits
for (`_step_time.py` says how, and turns the tally into a `StepTime`)."""

import dataclasses
import functools
from collections import defaultdict
from typing import Literal

from .. import _compiler
from .._compiler import Computation, Instruction
from ._costs import FREE, HostWork, Program
from ._hardware import Hardware


_On = Literal["link", "device", "host"]  # what a started instruction occupies
# What the device waiting on each counts as.
_WAITS = {"link": "exposed", "host": "host_bound", "device": "hbm_bound"}
# The host link: each direction, and both together.
_LINKS = ("host_to_device", "device_to_host", "both")


_sums = functools.partial(defaultdict, float)
_counts = functools.partial(defaultdict, int)


@dataclasses.dataclass
class _Tally:
    """Time and work of one run of a computation."""

    seconds: float = 0.0
    compute_bound: float = 0.0
    hbm_bound: float = 0.0
    exposed: float = 0.0
    exposed_by_phase: dict[str, float] = dataclasses.field(default_factory=_sums)
    link_by_phase: dict[str, float] = dataclasses.field(default_factory=_sums)
    host_bound: float = 0.0  # waiting for host compute
    compute: float = 0.0
    hbm: float = 0.0
    hbm_bytes: float = 0.0
    host: float = 0.0  # host compute, busy
    host_bytes: int = 0
    host_flops: float = 0.0
    flops: dict[str, float] = dataclasses.field(default_factory=_sums)
    link_bytes: dict[str, int] = dataclasses.field(default_factory=_counts)
    # When (after the run starts) its first transfer in each direction, and its
    # first transfer at all ("both"), may begin: what a caller's transfers still
    # in flight delay.
    first_link: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, other: "_Tally", times: int = 1) -> None:
        """Adds `times` runs of `other` (all but when its transfers begin)."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, defaultdict):
                for k, v in theirs.items():
                    mine[k] += times * v
            elif f.name != "first_link":
                setattr(self, f.name, mine + times * theirs)


@dataclasses.dataclass
class _Run:
    """One replay of a computation.

    It holds its clock, when each resource is next free, and the asynchronous work
    started and not yet waited for.
    """

    tally: _Tally
    clock: float = 0.0
    link_free: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(_LINKS, 0.0)
    )
    # The part of the step the transfer last on each of `link_free` belongs to.
    link_phase: dict[str, str] = dataclasses.field(default_factory=dict)
    # Until when the share of transfers that cannot overlap holds device work up
    # (other transfers still start), and the part of the step they belong to.
    held: tuple[float, str] = (0.0, "")
    other_free: float = 0.0  # the device's asynchronous work
    host_free: float = 0.0  # the host's CPU
    # start -> (finish, on what, the part of the step it belongs to)
    pending: dict[str, tuple[float, _On, str]] = dataclasses.field(default_factory=dict)

    def wait(self, until: float, on: _On, phase: str = "") -> None:
        """Moves the clock to `until`, counting the wait against what it is on."""
        if until > self.clock:
            field = _WAITS[on]
            setattr(self.tally, field, getattr(self.tally, field) + until - self.clock)
            if on == "link":
                self.tally.exposed_by_phase[phase] += until - self.clock
            self.clock = until


class Replay:
    """Replays a program's computations, each once (memoised), on `hardware`."""

    def __init__(self, program: Program, hardware: Hardware):
        self.program = program
        self.hw = hardware
        self.rate = {d: getattr(hardware, f"{d}_bytes_per_second") for d in _LINKS[:2]}
        self.memo: dict[str, _Tally] = {}

    def run(self, name: str) -> _Tally:
        if name in self.memo:
            return self.memo[name]
        self.memo[name] = _Tally()  # (a cycle, which HLO has not, costs nothing)
        comp = self.program.comps.get(name)
        tally = _Tally() if comp is None else self._run(comp)
        self.memo[name] = tally
        return tally

    def _run(self, comp: Computation) -> _Tally:
        run = _Run(_Tally())
        for inst in comp.insts.values():
            self._step(run, comp, inst)
        for finish, on, phase in run.pending.values():  # never waited for here
            run.wait(finish, on, phase)
        run.tally.seconds = run.clock
        return run.tally

    def _step(self, run: _Run, comp: Computation, inst: Instruction) -> None:
        """Replays one instruction."""
        op = inst.opcode
        if op in FREE:
            return
        if op.endswith("-done"):
            start = inst.operands[0] if inst.operands else ""
            if start in run.pending:
                run.wait(*run.pending.pop(start))
            return
        if (moving := self.program.transfer(comp, inst)) is not None:
            self._transfer(run, comp, inst, moving)
            return
        if (work := self.program.host_work(comp, inst)) is not None:
            self._host_work(run, inst, work)
            return
        called = self._called(comp, inst)
        run.wait(run.held[0], "link", run.held[1])  # device work waits for it
        if called is None:  # work: a fusion, a dot, a copy, a collective, ...
            self._device_work(run, comp, inst)
        for name, times in called or ():
            inner = self.run(name)
            if not times:
                continue
            self._enter(run, inner)
            run.tally.add(inner, times)
            for key, at in inner.first_link.items():
                run.tally.first_link.setdefault(key, run.clock + at)
            run.clock += times * inner.seconds

    def _enter(self, run: _Run, inner: _Tally) -> None:
        """Before a called computation: its first transfer in a direction waits
        for what the caller still has in flight there (each computation is
        replayed once, on a free link)."""
        if late := [
            (run.link_free[key] - run.clock - at, key)
            for key, at in inner.first_link.items()
            if run.link_free[key] > run.clock + at
        ]:
            delay, key = max(late)
            run.wait(run.clock + delay, "link", run.link_phase.get(key, ""))

    def _transfer(
        self, run: _Run, comp: Computation, inst: Instruction, moving: tuple[str, int]
    ) -> None:
        """A transfer (`moving`: its direction and bytes) occupies the link in its
        direction from when it is issued."""
        (direction, nbytes), t = moving, run.tally
        t.link_bytes[direction] += nbytes
        begin = max(run.clock, run.link_free[direction])
        finish = begin + nbytes / self.rate[direction]
        phase = _compiler.phase(_named(comp, inst).op_name)
        t.first_link.setdefault(direction, begin)
        both = self.hw.both_ways_bytes_per_second
        if both is not None:  # both directions share the link's total rate
            t.first_link.setdefault("both", begin)
            shared = max(begin, run.link_free["both"]) + nbytes / both
            finish = max(finish, shared)
            run.link_free["both"] = shared
            run.link_phase["both"] = phase
        run.link_free[direction] = finish
        run.link_phase[direction] = phase
        t.link_by_phase[phase] += nbytes / self.rate[direction]
        if not inst.opcode.endswith("-start"):
            run.wait(finish, "link", phase)
            return
        # The share that cannot overlap holds device work up from when it begins.
        held = finish - self.hw.transfer_overlap * (finish - begin)
        if held > run.held[0]:
            run.held = (held, phase)
        run.pending[inst.name] = (finish, "link", phase)

    def _host_work(self, run: _Run, inst: Instruction, work: HostWork) -> None:
        """Host compute occupies the host's CPU from when it is issued."""
        took = max(
            work.nbytes / self.hw.host_memory_bytes_per_second,
            work.flops / self.hw.host_flops,
        )
        t = run.tally
        t.host += took
        t.host_bytes += work.nbytes
        t.host_flops += work.flops
        run.host_free = max(run.clock, run.host_free) + took
        if work.asynchronous:
            run.pending[inst.name] = (run.host_free, "host", "")
        else:
            run.wait(run.host_free, "host")

    def _called(
        self, comp: Computation, inst: Instruction
    ) -> list[tuple[str, int]] | None:
        """The computations a loop, conditional (`Walker.control`) or call runs,
        with how many times each. `None` for other instructions."""
        found = self.program.walker.control(comp, inst)
        if found is None and inst.opcode == "call" and inst.computation("to_apply"):
            return [(inst.computation("to_apply") or "", 1)]
        return found

    def _device_work(self, run: _Run, comp: Computation, inst: Instruction) -> None:
        """An instruction that computes takes the longer of its matmul FLOPs and
        its device-memory bytes."""
        t = run.tally
        compute = 0.0
        for p, n in self.program.flops(comp, inst).items():
            used, rate = self.hw.flops_per_second(p)
            t.flops[used] += n
            compute += n / rate
        nbytes = self.program.device_bytes(comp, inst)
        memory = nbytes / self.hw.hbm_bytes_per_second / self.hw.compute_efficiency
        compute /= self.hw.compute_efficiency
        t.compute += compute
        t.hbm += memory
        t.hbm_bytes += nbytes
        took = max(compute, memory)
        if inst.opcode.endswith("-start"):
            run.other_free = max(run.clock, run.other_free) + took
            run.pending[inst.name] = (run.other_free, "device", "")
            return
        if compute >= memory:
            t.compute_bound += took
        else:
            t.hbm_bound += took
        run.clock += took


def _named(comp: Computation, inst: Instruction) -> Instruction:
    """`inst`, or where it has no op name (a transfer XLA made, peeled off a loop),
    the nearest of its operands' producers that has one: the part of the step it
    belongs to is theirs."""
    seen, todo = set(), [inst]
    while todo:
        found = todo.pop(0)
        if found.op_name:
            return found
        for name in found.operands:
            if name not in seen and name in comp.insts:
                seen.add(name)
                todo.append(comp.insts[name])
    return inst
