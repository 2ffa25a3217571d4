"""What each instruction of a compiled program costs: its matmul FLOPs and the
precision they run at, the bytes it reads and writes in device memory, the bytes
it moves between host and device, and the work it gives the host's CPU (host
compute, `compute_on("device_host")`: its host-memory bytes and FLOPs)
(`_step_time.py` adds them up along the schedule). The text is read in
`_compiler.py`."""

import math
from collections import defaultdict
from typing import Any, NamedTuple

from .. import _compiler
from .._compiler import Computation, Instruction
from ._hlo_program import made, moved, Walker


# Instructions that move or compute nothing.
FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "opt-barrier",
    "after-all",
    "partition-id",
    "replica-id",
    "add-dependency",
    "domain",
}
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")
_SLICES = {"dynamic-slice", "slice", "gather"}
# Instructions that move or lay out data without arithmetic: on the host's CPU, a
# compiler that fuses elementwise loops computes them as it reads (a broadcast of
# a constant is never written out). Every other instruction of host compute costs
# one FLOP per element it computes (a reduction, per element it reads).
_NO_ARITHMETIC = {
    *FREE,
    *_SLICES,
    "broadcast",
    "reshape",
    "transpose",
    "copy",
    "dynamic-update-slice",
    "pad",
    "concatenate",
    "iota",
    "reverse",
    "bitcast-convert",
}


class HostWork(NamedTuple):
    """What one instruction gives the host's CPU to do."""

    nbytes: int  # host memory read and written
    flops: float
    asynchronous: bool  # a start the device need not wait for until its done


def precision(
    dtypes: tuple[str, str], operand_precision: list[str], platform: str
) -> str:
    """The precision a dot of operand types `dtypes` runs at (see
    `_hardware.PRECISIONS`): at the default precision a float32 dot takes one
    bfloat16 pass on a TPU and runs as TF32 on an H100 (JAX's
    `jax.lax.Precision`)."""
    kinds = set(dtypes)
    if any(d.startswith("f8") for d in kinds):
        return "fp8"
    if kinds & {"s8", "u8", "s4", "u4"}:
        return "int8"
    if kinds <= {"bf16", "f16"}:
        return "bf16"
    if "f64" in kinds:
        return "f64"
    levels = ("default", "high", "highest")
    level = max((levels.index(p) for p in operand_precision if p in levels), default=0)
    if platform == "tpu":
        return ("bf16", "bf16x3", "bf16x6")[level]
    return ("tf32", "tf32", "f32")[level]


class Program:
    """A parsed compiled program and what is known of its computations."""

    def __init__(self, text: str, platform: str):
        self.comps, self.entry = _compiler.parse_hlo(text)
        self.walker = Walker(self.comps, self.entry)
        self.platform = platform
        self._flops: dict[str, tuple[tuple[str, float], ...]] = {}
        self._accesses: dict[str, tuple[dict[int, int], int | None]] = {}

    def shape(self, comp: Computation, name: str) -> str:
        inst = comp.insts.get(name)
        return inst.shape if inst is not None else ""

    def dot_flops(
        self, comp: Computation, inst: Instruction
    ) -> tuple[str, float] | None:
        """(precision, FLOPs) of a dot, convolution or GEMM library call."""
        gemm = _gemm_config(inst)
        is_dot = inst.opcode in ("dot", "convolution")
        if not (is_dot or gemm is not None) or len(inst.operands) < 2:
            return None
        shape = inst.shape
        if gemm is not None and shape.startswith("("):  # (result, workspace)
            shape = _compiler.tuple_elements(shape)[0]
        shapes = [self.shape(comp, o) for o in inst.operands[:2]] + [shape]
        types: Any = [_compiler.array_type(s) for s in shapes]
        if None in types:  # (of an operand or result that is not one array)
            return None
        (lhs_type, lhs), (rhs_type, rhs), (_, out) = types
        dims, level = _contracting(inst, gemm)
        inner = math.prod(lhs[d] for d in dims if d < len(lhs))
        if inst.opcode == "convolution":
            inner = _convolution_inner(inst, lhs, rhs, out)
        if inner is None:
            return None
        flops = 2.0 * math.prod(out) * inner
        return precision((lhs_type, rhs_type), level, self.platform), flops

    def has_batched_dots(self) -> bool:
        """Whether any matmul has batch dimensions (as attention's have: one
        product per batch element and head), fused ones included."""
        for comp in self.comps.values():
            for inst in comp.insts.values():
                numbers = (_gemm_config(inst) or {}).get("dot_dimension_numbers", {})
                if numbers.get("lhs_batch_dimensions") or (
                    inst.opcode == "dot" and inst.dims("lhs_batch_dims")
                ):
                    return True
        return False

    def flops(self, comp: Computation, inst: Instruction) -> dict[str, float]:
        """An instruction's matmul FLOPs by precision, those of the computation it
        calls (a fusion's) included."""
        out: dict[str, float] = defaultdict(float)
        if (found := self.dot_flops(comp, inst)) is not None:
            out[found[0]] += found[1]
        callee = inst.computation("calls")
        for p, n in self._fused_flops(callee) if callee is not None else ():
            out[p] += n
        return out

    def _fused_flops(self, name: str) -> tuple[tuple[str, float], ...]:
        """The dot FLOPs of a fused (or otherwise called) computation, by precision."""
        if name in self._flops:
            return self._flops[name]
        self._flops[name] = ()
        if (comp := self.comps.get(name)) is None:
            return ()
        out: dict[str, float] = defaultdict(float)
        for inst in comp.insts.values():
            for p, n in self.flops(comp, inst).items():
                out[p] += n
        self._flops[name] = tuple(out.items())
        return self._flops[name]

    def device_bytes(self, comp: Computation, inst: Instruction) -> int:
        """What `inst` reads and writes in device memory (HBM): its result and its
        operands there; of a slice, the slice (read and written); of a buffer
        updated in place, the update; of an operand a fusion only slices, the
        slices. (Of an asynchronous start, the result it starts.)"""
        base = inst.opcode.removesuffix("-start")
        result = made(inst)
        operands = [self.shape(comp, name) for name in inst.operands]
        if base in ("slice", "dynamic-slice") and operands:
            read = _hbm(result) if _hbm(operands[0]) else 0
            return read + _hbm(result)
        if base == "dynamic-update-slice" and len(operands) > 1:
            return 2 * _hbm(operands[1]) if _hbm(operands[0]) else _hbm(operands[1])
        sliced, in_place, result = self._fused(inst, result)
        return _hbm(result) + sum(
            sliced.get(i, _hbm(shape))
            for i, shape in enumerate(operands)
            if i != in_place
        )

    def _fused(
        self, inst: Instruction, result: str
    ) -> tuple[dict[int, int], int | None, str]:
        """Of a fusion: the operands it only slices, the one it updates in place,
        and its result (of an update in place, the update)."""
        callee = inst.computation("calls") if inst.opcode == "fusion" else None
        if (fused := self.comps.get(callee or "")) is None:
            return {}, None, result
        sliced, in_place = self._access(fused.name)
        root = fused.insts.get(fused.root)
        if in_place is not None and root is not None and len(root.operands) > 1:
            result = self.shape(fused, root.operands[1])  # the update
        return sliced, in_place, result

    def _access(self, name: str) -> tuple[dict[int, int], int | None]:
        """Of a fused computation: the parameters it only slices (number ->
        bytes of the slices), and the one it updates in place."""
        if name in self._accesses:
            return self._accesses[name]
        comp = self.comps[name]
        users: dict[str, list[Instruction]] = defaultdict(list)
        for inst in comp.insts.values():
            for o in inst.operands:
                users[o].append(inst)
        sliced = {}
        for number, param in comp.params.items():
            found = users.get(param, [])
            if found and all(
                u.opcode in _SLICES and u.operands[:1] == [param] for u in found
            ):
                sliced[number] = sum(
                    a.nbytes for u in found for a in _compiler.arrays(u.shape)
                )
        self._accesses[name] = (sliced, _in_place(comp))
        return self._accesses[name]

    def host_work(self, comp: Computation, inst: Instruction) -> HostWork | None:
        """The host's work in `inst`, if it is host compute:

        - the start of a host computation (`HostExecute`): its computation reads
            its parameters and writes its results once, as a CPU compiler that
            fuses the elementwise work into loops runs it, plus one more read of
            each reduction's input (a global norm is a pass of its own);
            asynchronous, waited for by its `done`;
        - an instruction marked to run on the host outside one (XLA:GPU's form):
            its operands and result;
        - a copy from host memory to host memory (a host computation's results
            into their buffers): read and written, by the host (not on a GPU,
            where it measured free).

        `None` for anything else."""
        if inst.host_calls:
            nbytes, flops = zip(*map(self._host_region, inst.host_calls))
            return HostWork(sum(nbytes), sum(flops), True)
        if inst.host_compute:
            shapes = [inst.shape] + [self.shape(comp, o) for o in inst.operands]
            callee = inst.computation("calls")
            flops = self._host_flops(callee) if callee else _flops(self, comp, inst)
            asynchronous = inst.opcode.endswith("-start")
            return HostWork(sum(_bytes(s) for s in shapes), flops, asynchronous)
        # XLA:GPU's copies of a host computation's results into their buffers
        # cost nothing measurable: on the H200 the 0.2B host-update step took
        # 476.6 ms, against 79.8 ms of device and link work plus 431 ms of the
        # update alone at its own measured rate, which leaves no time for 4.0 GB of
        # copies (benchmarks/calibration.py).
        if inst.opcode == "copy" and len(inst.operands) == 1 and self.platform != "gpu":
            out = _compiler.arrays(inst.shape)
            source = _compiler.arrays(self.shape(comp, inst.operands[0]))
            if out and source and all(a.host for a in out + source):
                return HostWork(2 * _bytes(inst.shape), 0.0, False)
        return None

    def _host_region(self, name: str) -> tuple[int, float]:
        """(host-memory bytes, FLOPs) of one run of a host computation."""
        if (comp := self.comps.get(name)) is None:
            return 0, 0.0
        nbytes = sum(_bytes(comp.insts[p].shape) for p in comp.params.values())
        root = comp.insts.get(comp.root)
        nbytes += _bytes(root.shape) if root is not None else 0
        for inst in comp.insts.values():
            if inst.opcode == "reduce" and inst.operands:
                nbytes += sum(_bytes(self.shape(comp, o)) for o in _reduced(inst))
        return nbytes, self._host_flops(name)

    def _host_flops(self, name: str) -> float:
        """The FLOPs of a computation run on the host (see `_NO_ARITHMETIC`)."""
        if (comp := self.comps.get(name)) is None:
            return 0.0
        return sum(_flops(self, comp, inst) for inst in comp.insts.values())

    def intermediate(self, name: str) -> int:
        """The bytes of the largest array host computation `name` computes that is
        not a result (`host_temporaries`)."""
        if (comp := self.comps.get(name)) is None:
            return 0
        root = comp.insts.get(comp.root)
        results = set(root.operands if root and root.opcode == "tuple" else [])
        results.add(comp.root)
        sizes = [
            _bytes(inst.shape)
            for inst in comp.insts.values()
            if inst.name not in results and inst.opcode not in _NO_ARITHMETIC
        ]
        return max(sizes, default=0)

    def transfer(self, comp: Computation, inst: Instruction) -> tuple[str, int] | None:
        """(direction, bytes) if `inst` moves data between host and device, or
        starts an asynchronous computation that does."""
        if (found := moved(comp, inst)) is not None:
            return found[0], found[1]
        inner = self.comps.get(inst.computation("calls") or "")
        if not inst.opcode.endswith("-start") or inner is None:
            return None
        totals: dict[str, int] = defaultdict(int)
        for i in inner.insts.values():
            if (m := moved(inner, i)) is not None:
                totals[m[0]] += m[1]
        if not totals:
            return None
        return max(totals, key=lambda d: totals[d]), sum(totals.values())


def host_temporaries(program: Program) -> int:
    """An estimate of the host memory a host computation of a compiled program
    takes while it runs, besides its parameters and results (the compiler's
    memory analysis counts the buffers of the program that calls it, not those of
    the computation it runs on the host): one array of the largest shape it
    computes. A CPU compiler that fuses the elementwise work into loops writes out
    at most such a value shared by two loops (the clipped gradient Adam's two
    moments read); the unfused text would hold many. The largest over the host
    computations, which run one at a time (0 for a program without host
    compute)."""
    insts = [inst for c in program.comps.values() for inst in c.insts.values()]
    calls = [name for inst in insts for name in inst.host_calls]
    return max(map(program.intermediate, calls), default=0)


def _flops(program: Program, comp: Computation, inst: Instruction) -> float:
    """The FLOPs of one instruction run on the host's CPU."""
    op = inst.opcode
    if op in _NO_ARITHMETIC or op.endswith("-done"):
        return 0.0
    if (callee := inst.computation("calls")) is not None:
        return program._host_flops(callee)
    if (found := program.dot_flops(comp, inst)) is not None:
        return found[1]
    if op == "reduce" and inst.operands:
        inputs = _reduced(inst)
        return float(sum(_compiler.elements(program.shape(comp, o)) for o in inputs))
    return float(_compiler.elements(inst.shape))


def _reduced(reduce: Instruction) -> list[str]:
    """The inputs of a `reduce` (its operands are inputs, then initial values)."""
    return reduce.operands[: max(len(reduce.operands) // 2, 1)]


def _bytes(shape: str) -> int:
    """The bytes of a shape's arrays, in whichever memory."""
    return sum(a.nbytes for a in _compiler.arrays(shape))


def _hbm(shape: str) -> int:
    """The bytes of a shape's arrays that are in device memory (HBM)."""
    return sum(
        a.nbytes for a in _compiler.arrays(shape) if not a.host and not a.on_chip
    )


def _convolution_inner(
    inst: Instruction, lhs: list[int], rhs: list[int], out: list[int]
) -> float | None:
    """The multiply-adds per output element of a convolution: the kernel's input
    features times, per spatial dimension, the window positions that land on the
    input (not on padding or the holes of a dilated input), averaged over the
    output positions. (The TPU compiler writes batched matmuls as convolutions
    whose batch dimensions are spatial, dilated so that one position lands.)"""
    labels = inst.dim_labels or ""
    try:
        lhs_labels, rest = labels.split("_", 1)
        rhs_labels, out_labels = rest.split("->", 1)
    except ValueError:
        return None
    if (
        "i" not in rhs_labels
        or len(rhs_labels) != len(rhs)
        or len(out_labels) != len(out)
    ):
        return None
    inner = float(rhs[rhs_labels.index("i")])
    window = inst.window
    spatial = sorted(c for c in rhs_labels if c.isdigit())
    for n, digit in enumerate(spatial):
        if digit not in lhs_labels or digit not in out_labels:
            return None
        size = lhs[lhs_labels.index(digit)]
        outputs = out[out_labels.index(digit)]
        get = lambda key, default: window.get(key, [default] * len(spatial))[n]  # noqa: E731
        k, stride, low = get("size", 1), get("stride", 1), get("pad_low", 0)
        base, dilate = get("lhs_dilate", 1), get("rhs_dilate", 1)
        at = [o * stride + w * dilate - low for o in range(outputs) for w in range(k)]
        landed = sum(0 <= a <= (size - 1) * base and a % base == 0 for a in at)
        inner *= landed / max(outputs, 1)
    return inner


def _contracting(
    inst: Instruction, gemm: dict[str, Any] | None
) -> tuple[list[int], list[str]]:
    """A matmul's contracting dimensions of its left operand, and its operands'
    precisions; of a GEMM call, from its configuration `gemm`."""
    if gemm is None:
        return inst.dims("lhs_contracting_dims"), inst.operand_precision
    numbers = gemm.get("dot_dimension_numbers", {})
    given = gemm.get("precision_config", {}).get("operand_precision", [])
    dims = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    return dims, [str(p).lower() for p in given]


def _gemm_config(inst: Instruction) -> dict[str, Any] | None:
    """The configuration of a GEMM library call; None for any other instruction."""
    if inst.opcode != "custom-call" or inst.custom_call_target not in _GEMM_TARGETS:
        return None
    return inst.backend_config.get("gemm_backend_config", {})


def _in_place(comp: Computation) -> int | None:
    """The parameter a fused computation updates in place (its root a
    `dynamic-update-slice` of it), if any."""
    root = comp.insts.get(comp.root)
    if root is None or root.opcode != "dynamic-update-slice" or not root.operands:
        return None
    base = comp.insts.get(root.operands[0])
    return None if base is None else base.parameter_number
