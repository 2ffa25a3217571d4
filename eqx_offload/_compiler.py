"""Reading the compiler's text: HLO, and error messages.

The HLO is a compiled function's, the TPU compiler's after optimisation (a lowered
function's StableHLO is read in `_compiler_stablehlo.py`). None of these texts is
a stable interface. Checked
against jax 0.10.2, jaxlib 0.10.2 and libtpu 0.0.42.1. Samples captured with them
are in `tests/fixtures/0.10.2/`. `tests/test_compiler_text.py` parses them, and
compares them with what this installation's compiler writes. So an upgrade that
changes the text fails there. The private Python parts of JAX and Equinox are in
`_compat.py`.
"""

import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

import jax.numpy as jnp

from . import _scopes


# Checked against (`tests/fixtures/<JAX_VERSION>/`).
JAX_VERSION = "0.10.2"
LIBTPU_VERSION = "0.0.42.1"


Phase = Literal["forward", "backward", "outside", "update"]


def phase(op_name: str) -> Phase:
    """The part of a train step an instruction belongs to, by its `op_name`.

    It is the optimizer update, or the forward or backward pass of a `Stacked`'s
    layers, inside its scans. Or it is the rest of the forward and backward
    passes: leaves outside every `Stacked`, such as an embedding or a head. JAX
    names what the backward pass computes `transpose(...)`.
    """
    parts = op_name.split("/")
    if _scopes.UPDATE in parts:
        return "update"
    if not any(_scopes.LAYERS in part for part in parts):
        return "outside"
    return "backward" if "transpose(" in op_name else "forward"


# Compile options.


def compile_options(platform: str, *, host_remat: bool) -> dict[str, Any] | None:
    """Every compiler option the library passes to a step compiled for `platform`
    (`train_step` and `memory_report` both take them from here, and
    `StepTime.compile_options` reports them), or `None` for none.

    `Policy(host_remat=True)` sets the TPU compiler's option that keeps values it
    would rematerialize in host memory instead (design notes, "JAX facts relied
    on"); a platform without that option gets `None` here, and the caller
    refuses it.
    """
    if host_remat and platform == "tpu":
        return {"xla_tpu_rematerialization_use_host_memory_offload": True}
    return None


# Error messages.

_SIZE = r"([0-9.]+)\s*([KMGT]?)i?B?"


def oom_sizes(message: str) -> tuple[int | None, int | None]:
    """The required and available bytes in a TPU compiler's out-of-memory message
    ("... required for HLO temporaries (20.00G) exceeds available HBM (15.75G)",
    or "Used 20.00G of 15.75G hbm"); `None` for a figure it does not give."""

    def nbytes(number: str, unit: str) -> int:
        return int(float(number) * 1024 ** "_KMGT".index(unit or "_"))

    used = re.search(rf"Used {_SIZE} of {_SIZE} hbm", message)
    if used:
        return nbytes(*used.group(1, 2)), nbytes(*used.group(3, 4))
    required = re.search(rf"required for [^(]*\({_SIZE}\)", message)
    available = re.search(rf"available HBM \({_SIZE}\)", message)
    return (
        nbytes(*required.group(1, 2)) if required else None,
        nbytes(*available.group(1, 2)) if available else None,
    )


def crash_line(stderr: str) -> str:
    """What a compiler that ended its process said last: its failed check (libtpu's
    "Check failed: ..." line), else the last line written to stderr."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return ([line for line in lines if "Check failed" in line] or lines or [""])[-1]


# HLO's element types, as `jnp.dtype` names.
_HLO_TYPES = {"pred": "bool", "bf16": "bfloat16"} | {
    f"{short}{bits}": f"{name}{bits}"
    for short, name in (("s", "int"), ("u", "uint"), ("f", "float"))
    for bits in (8, 16, 32, 64)
    if (short, bits) != ("f", 8)  # (8-bit floats are `f8e4m3fn`, ...)
}
_HLO_SHAPE = re.compile(r"\b(" + "|".join(_HLO_TYPES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_EXPECTED = re.compile(r"shape equal to \((.*?)\), actual shape is \((.*?)\):", re.S)


def array_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The array types a compiler message (or HLO) is about, in order, no repeats.

    Each is `(dtype name, shape)`: `("float32", (2, 2048, 8192))` for
    `f32[2,2048,8192]{2,1,0:T(8,128)S(5)}`. A message may compare an expected tuple
    of types with the actual one: "Expected instruction to have shape equal to
    (...), actual shape is (...)". Then only the entries that differ count, in
    layout or memory space (`S(5)` is host memory).
    """
    compared = _EXPECTED.search(text)
    if compared is not None:
        expected, actual = (_HLO_SHAPE.findall(t) for t in compared.groups())
        if len(expected) == len(actual):
            differ = [e for e, a in zip(expected, actual) if e != a]
            return list(dict.fromkeys(_shape(t, dims) for t, dims, _ in differ))
    return list(dict.fromkeys(_shape(t, d) for t, d, _ in _HLO_SHAPE.findall(text)))


def _shape(hlo_type: str, dims: str) -> tuple[str, tuple[int, ...]]:
    return _HLO_TYPES[hlo_type], tuple(int(d) for d in dims.split(",") if d)


def op_names(text: str) -> list[str]:
    """The `op_name`s of the instructions quoted in a compiler message (or HLO)."""
    return re.findall(r'op_name="([^"]*)"', text)


# Parts of an `op_name` that are JAX's structure, not a named scope.
_STRUCTURE = re.compile(
    r"^(while|body|cond|closed_call|checkpoint|remat|rematted_computation"
    r"|compute_on|branch_\d+_fun|jit\(.*\)|vmap\(.*\)|pjit|scan|.*_p)$"
)


def in_host_compute(op_name: str) -> bool:
    """Whether an `op_name` is JAX's host compute's (`compute_on`), or an
    operation inside it."""
    return "compute_on" in op_name.split("/")[1:]


def named_scopes(op_name: str) -> list[str]:
    """The `jax.named_scope`s of an `op_name`, outermost first: without the jitted
    function's name, the operation's own name, and JAX's transformations and
    control flow (`jvp(...)`, `while/body`, ...)."""
    out = []
    for part in op_name.split("/")[1:-1]:
        while "(" in part and part.endswith(")") and not part.startswith("jit("):
            part = part[part.index("(") + 1 : -1]
        if part and not _STRUCTURE.match(part):
            out.append(part)
    return out


# HLO (`compiled.as_text()`), where host memory is memory space 5 (`S(5)`).

_BYTES = {t: jnp.dtype(name).itemsize for t, name in _HLO_TYPES.items()}
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_INTEGER = re.compile(r"-?\d+")
_JSON = json.JSONDecoder()


class Array(NamedTuple):
    """One array of an HLO shape."""

    nbytes: int
    host: bool  # in host memory (memory space 5)
    # In an on-chip memory (a TPU's VMEM and SMEM: memory spaces other than the
    # device's 0 and the host's 5), not in device memory (HBM).
    on_chip: bool = False


class Instruction(NamedTuple):
    """One instruction of an HLO computation, as written:
    `%name = shape opcode(args), attrs`."""

    name: str
    shape: str  # an array type, or a tuple of them: "(f32[8]{0}, s32[])"
    opcode: str
    args: str  # the text between the parentheses (a constant's value)
    operands: list[str]
    attrs: str

    def _attr(self, pattern: str, convert: Callable[[str], Any] = str) -> Any:
        """The first group of `pattern` in its attributes (`convert`ed), or `None`."""
        found = re.search(pattern, self.attrs)
        return convert(found[1]) if found else None

    def computation(self, key: str) -> str | None:
        """The computation an attribute names (`body`, `condition`, `calls`, ...)."""
        return self._attr(rf"\b{key}=%([^\s,}}]+)")

    def _computations(self, key: str) -> list[str]:
        """The computations an attribute lists: `key={%a, %b}`."""
        found = self._attr(rf"\b{key}=\{{([^}}]*)\}}") or ""
        return re.findall(r"%([^\s,}]+)", found)

    @property
    def branches(self) -> list[str]:
        """A `conditional`'s branch computations, in order."""
        pair = [self.computation(f"{b}_computation") for b in ("true", "false")]
        return self._computations("branch_computations") + [n for n in pair if n]

    @property
    def known_trip_count(self) -> int | None:
        """A `while` loop's trip count, where the compiler knows it."""
        return self._attr(r'"known_trip_count":\{"n":"(\d+)"', int)

    @property
    def direction(self) -> str | None:
        """A `compare`'s direction: "LT", "GE", ..."""
        return self._attr(r"\bdirection=(\w+)")

    @property
    def index(self) -> int | None:
        """A `get-tuple-element`'s index."""
        return self._attr(r"index=(\d+)", int)

    @property
    def dim_labels(self) -> str | None:
        """A `convolution`'s dimension labels: "bf_io->bf" (lhs, rhs -> result;
        `b` batch, `f` feature, `i`/`o` the kernel's input/output feature, digits
        spatial)."""
        return self._attr(r"\bdim_labels=(\S+?)(?:,|$)")

    def dims(self, key: str) -> list[int]:
        """The dimension numbers an attribute lists: `lhs_contracting_dims={1}`,
        `rhs_batch_dims={0}`, ... (empty if absent)."""
        found = self._attr(rf"\b{key}=\{{([0-9,]*)\}}") or ""
        return [int(d) for d in found.split(",") if d]

    @property
    def operand_precision(self) -> list[str]:
        """A `dot`'s or `convolution`'s operand precisions ("highest", "high";
        empty at the default)."""
        found = self._attr(r"\boperand_precision=\{([a-z,]*)\}")
        return [] if found is None else found.split(",")

    @property
    def window(self) -> dict[str, list[int]]:
        """A `convolution`'s window, per spatial dimension: `size`, `stride`,
        `pad_low`, `pad_high`, `lhs_dilate`, `rhs_dilate` (each present when the
        text gives it; `{}` for no window)."""
        out: dict[str, list[int]] = {}
        for item in (self._attr(r"\bwindow=\{([^}]*)\}") or "").split():
            key, _, value = item.partition("=")
            if key == "pad":
                pairs = [p.split("_") for p in value.split("x")]
                out["pad_low"] = [int(lo) for lo, _ in pairs]
                out["pad_high"] = [int(hi) for _, hi in pairs]
            elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
                out[key] = [int(d) for d in value.split("x")]
        return out

    @property
    def is_host_call(self) -> bool:
        """Whether it starts (or is) a call of a host computation (JAX's
        `compute_on("device_host")`: XLA's `HostExecute` custom call)."""
        return (
            self.opcode in ("custom-call-start", "custom-call")
            and self.custom_call_target == "HostExecute"
        )

    @property
    def custom_call_target(self) -> str | None:
        return self._attr(r'\bcustom_call_target="([^"]*)"')

    @property
    def host_compute(self) -> bool:
        """Whether the compiler marked it to run on the host's CPU
        (`frontend_attributes={_xla_compute_type="host"}`): how XLA:GPU writes the
        host compute of `compute_on("device_host")` that it inlines into a device
        computation."""
        return '_xla_compute_type="host"' in self.attrs

    @property
    def host_calls(self) -> list[str]:
        """The computations an asynchronous start runs on the host's CPU: the TPU
        and GPU compilers write `compute_on("device_host")` as `custom-call-start`
        to `HostExecute` on the host thread (`async_execution_thread="host"`,
        `called_computations={%...}`), waited for by its `custom-call-done`. Empty
        for any other instruction."""
        if not self.opcode.endswith("-start"):
            return []
        on_host = 'async_execution_thread="host"' in self.attrs
        if not on_host and self.custom_call_target != "HostExecute":
            return []
        return self._computations("called_computations")

    @property
    def backend_config(self) -> dict:
        """Its `backend_config` (a JSON object), or {}."""
        start = self.attrs.find("backend_config={")
        if start < 0:
            return {}
        try:  # the JSON object there, whatever follows it
            found, _ = _JSON.raw_decode(self.attrs, start + len("backend_config="))
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    @property
    def op_name(self) -> str:
        """The `op_name` of its metadata (JAX's name for it), or ""."""
        found = op_names(self.attrs)
        return found[0] if found else ""

    @property
    def constant(self) -> int | None:
        """A `constant`'s value, if it is one integer."""
        return self._integer() if self.opcode == "constant" else None

    @property
    def parameter_number(self) -> int | None:
        """A `parameter`'s number."""
        return self._integer() if self.opcode == "parameter" else None

    def _integer(self) -> int | None:
        text = self.args.strip()
        return int(text) if _INTEGER.fullmatch(text) else None


class Computation(NamedTuple):
    name: str
    insts: dict[str, Instruction]
    params: dict[int, str]  # parameter number -> instruction name
    root: str


class HloModule(NamedTuple):
    computations: dict[str, Computation]
    entry: str  # the entry computation's name


def _array_parts(shape: str) -> Iterator[tuple[str, int, str]]:
    """(dtype, elements, layout) of each array of a shape (one, or a tuple's),
    skipping tokens and opaque types."""
    for dtype, dims, layout in _ARRAY.findall(shape):
        if dtype not in _BYTES and not dtype.startswith(("f8", "s4", "u4")):
            continue
        yield dtype, math.prod(int(d) for d in dims.split(",") if d), layout or ""


def arrays(shape: str) -> list[Array]:
    """The arrays of a shape (one, or a tuple's), skipping tokens and opaque types."""
    out = []
    for dtype, n, layout in _array_parts(shape):
        space = re.search(r"S\((\d+)\)", layout)
        number = int(space[1]) if space else 0
        out.append(Array(n * _BYTES.get(dtype, 1), number == 5, number not in (0, 5)))
    return out


def elements(shape: str) -> int:
    """The number of elements of a shape's arrays (a tuple's, summed), skipping
    tokens and opaque types."""
    return sum(n for _, n, _ in _array_parts(shape))


def array_type(shape: str) -> tuple[str, list[int]] | None:
    """The element type and dimensions of a one-array shape: `("f32", [8, 128])`
    for "f32[8,128]{1,0}"; None for a tuple or a token."""
    found = _ARRAY.findall(shape)
    if len(found) != 1 or shape.startswith("("):
        return None
    dtype, dims, _ = found[0]
    return dtype, [int(d) for d in dims.split(",") if d]


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape `(a, b, ...)`."""
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            out.append(shape[start:i].strip())
            start = i + 1
    return out


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def _instruction(line: str) -> Instruction | None:
    line = line.strip().removeprefix("ROOT ")
    if not line.startswith("%") or " = " not in line:
        return None
    name, rest = line[1:].split(" = ", 1)
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    end = _closing(rest, paren)
    args = rest[paren + 1 : end]
    operands = re.findall(r"%([^\s,()]+)", args)
    return Instruction(name, shape, opcode, args, operands, rest[end + 1 :])


def has_host_compute(text: str) -> bool:
    """Whether a compiled program runs anything on the host's CPU (a computation
    on the host thread, or an instruction marked for the host): a test cheaper
    than parsing it."""
    return 'execution_thread="host"' in text or '_xla_compute_type="host"' in text


def parse_hlo(text: str) -> HloModule:
    """The computations of an HLO module's text, and the entry's name."""
    comps: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%(\S+) \(.*\{\s*$", line)
        if header:
            current = Computation(header[2], {}, {}, "")
            entry = header[2] if header[1] else entry
            continue
        if line.startswith("}") and current is not None:
            comps[current.name] = current
            current = None
        inst = None if current is None else _instruction(line)
        if current is None or inst is None:
            continue
        current.insts[inst.name] = inst
        if line.strip().startswith("ROOT "):
            current = current._replace(root=inst.name)
        if inst.parameter_number is not None:
            current.params[inst.parameter_number] = inst.name
    return HloModule(comps, entry)
