"""The loop over the pieces of one group, for `_streaming.py`.

It is a `lax.scan`. Each step reads a piece of each input, runs the piece jaxpr
on it, and writes the new piece back into its leaf.

On a TPU, step `k` reads piece `k` of each input; the compiler streams it from
the host. Elsewhere, step `k` reads piece `k + 1` of the inputs it overwrites
and carries it to the next step: the last piece is updated after the loop, so
that nothing is read twice. (On a TPU that read-ahead keeps two pieces on the
device, which costs memory.) Two reasons:

- XLA:CPU fuses the read of piece `k` into another input's new piece, after the
  write into the first. It then copies every overwritten input at every step.
- A GPU moves host data with copy engines, one each way: a read and a write in
  flight together use the link both ways. A read of piece `k + 1` need not wait
  for the update of piece `k`.

So step `k` reads piece `k + 1` of a leaf after computing its new piece `k` and
before writing that back (`_Loop.store_ahead`). Were the read after the write, it
would wait for it: the GPU would use the link one way at a time. Each read also
waits for the write into the leaf two before it: one write runs beside one
read, and the device holds at most one piece more than when reads wait for
writes.

The loop counts its index in its carry (not `xs=jnp.arange(...)`) and reads no
clamped offset: XLA:GPU runs a slice of a host array on a copy engine only if
its offset is affine in the loop's counter over the whole trip count. Any other
slice becomes a kernel that moves the bytes over PCIe with the GPU's cores. (So
are the reads before the loop and the writes after it, at constant offsets: one
piece of each leaf; and a loop of one step, which XLA removes.)
`tests/gpu_thunks.py` reads which.
"""

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .. import _jaxpr_dataflow as _dataflow, _tiling
from .._memory_kinds import to_space


class Input(NamedTuple):
    """One input of the update: a gradient, a state leaf or a parameter."""

    position: int  # among the update's inputs: gradients, state, then parameters
    value: Any
    label: str  # the named scope of its transfers
    group: Any  # the key of its group of pieces; None: it is updated whole


@dataclasses.dataclass
class Group:
    """Leaves streamed together: `pieces` slices of `rows` rows along axis 0, each
    as many rows of each of `shards` parts (`_tiling.parts`)."""

    key: Any
    pieces: int
    rows: int
    shards: int = 1
    inputs: list[Input] = dataclasses.field(default_factory=list)


class Output(NamedTuple):
    """One value a loop over the pieces of a group computes, and how it comes back."""

    whole: Any  # its reference in the whole jaxpr (a variable id or a `Literal`)
    piece: Any  # its counterpart in the piece jaxpr
    # The memory kind of each new piece, stacked by the loop into the new leaf;
    # None for partials, which come back with a leading axis of pieces.
    kind: str | None = None
    label: str = ""  # the named scope of its transfers
    overwrite: int | None = None  # the input written piece by piece with it, in place
    summed: bool = False  # a metric: added up over the pieces, back as its sum
    group: Any = None  # the key of the group whose loop computes it; None: none
    replaces: Input | None = None  # the input whose new value it is (a new leaf)


def scan_pieces(
    dataflow: _dataflow.Dataflow,
    group: Group,
    env: dict,
    outputs: list[Output],
    read_in_step: tuple[str, ...],
) -> list:
    """The value of each of `outputs`, computed piece by piece over `group`.

    Each piece's inputs are sliced from their leaves and moved to the device
    inside the loop: one piece is there at a time. An output with an `overwrite`
    input is written into that input piece by piece. (It is a loop carry: with
    the input donated, the write is in place.) A `summed` output is added up in
    the carry. The others come back stacked by the scan, pieces first. Step `k`
    reads piece `k` on the backends of `read_in_step`, else piece `k + 1`."""
    loop = _Loop.build(dataflow, group, env, outputs)
    fulls = [x.value for x in loop.carried]
    fulls += [jnp.zeros((), jnp.float32)] * (len(loop.slot) - len(loop.carried))
    others = [x.value for x in loop.streamed]
    if loop.carried:
        direct = dict.fromkeys(
            read_in_step, functools.partial(loop.run, read_ahead=False)
        )
        ahead = functools.partial(loop.run, read_ahead=True)
        fulls, ys = jax.lax.platform_dependent(fulls, others, **direct, default=ahead)
    else:
        fulls, ys = loop.run(fulls, others, read_ahead=False)
    return loop.collect(fulls, iter(ys))


@dataclasses.dataclass
class _Loop:
    """One loop over the pieces of a group: what each step reads and writes.

    A step's carry (`fulls`) is the overwritten inputs, then one running sum
    per summed output; `others` are the inputs only read."""

    piece: _dataflow.FlatJaxpr
    group: Group
    outputs: list[Output]
    known: dict  # values of the piece jaxpr every step reads (constants, shared)
    wanted: list[int]  # the equations each step evaluates
    used: set[int]  # the variables of the piece jaxpr the steps read
    carried: list[Input]  # the inputs overwritten piece by piece
    streamed: list[Input]  # the inputs only read, a piece per step
    # Output index -> its carry slot: its overwritten input's, or its running sum's.
    slot: dict[int, int]

    @classmethod
    def build(
        cls,
        dataflow: _dataflow.Dataflow,
        group: Group,
        env: dict,
        outputs: list[Output],
    ) -> "_Loop":
        piece, wholes = dataflow.piece, [o.whole for o in outputs]
        wanted = dataflow.piece_eqns(wholes)
        known = dict(piece.consts)
        for w_ref, p_ref in dataflow.shared_inputs(wholes):  # what the body reads
            known[p_ref] = env[w_ref]
        # Only the pieces the body computes with are read (a global norm's scan
        # needs the gradients, not the moments).
        used = _dataflow.reads(piece, wanted, [o.piece for o in outputs])
        overwritten = {o.overwrite for o in outputs}
        carried = [x for x in group.inputs if x.position in overwritten]
        needed = [x for x in group.inputs if piece.ins[x.position] in used]
        streamed = [x for x in needed if x.position not in overwritten]
        slot = _slots(outputs, carried)
        return cls(piece, group, outputs, known, wanted, used, carried, streamed, slot)

    def read(self, full: Any, index: Any, x: Input) -> Any:
        """Piece `index` of `full` (input `x`'s leaf), on the device."""
        cut = self.group.rows, self.group.shards
        with jax.named_scope(x.label):
            value = to_space(_tiling.read(full, index, *cut), "device", "")
            return _tiling.lift(value, *cut)

    def current(self, fulls: list, index: Any) -> list:
        """Piece `index` of each overwritten input. A leaf whose new value does
        not read the old (a compute copy) is written without being read."""
        return [
            self.read(f, index, x) if self.piece.ins[x.position] in self.used else None
            for f, x in zip(fulls, self.carried)
        ]

    def compute(self, index: Any, others: list, current: list) -> list:
        """The value of each output for piece `index`, from the pieces of the
        overwritten inputs (`current`) and of the others (read here)."""
        ins = self.piece.ins
        local = dict(self.known)
        for x, full in zip(self.streamed, others):
            local[ins[x.position]] = self.read(full, index, x)
        for x, value in zip(self.carried, current):
            local[ins[x.position]] = value
        _dataflow.run(self.piece, self.wanted, local)
        return [_dataflow.value(o.piece, local) for o in self.outputs]

    def store_ahead(self, index: Any, values: list, fulls: list) -> tuple:
        """Piece `index`'s `values` stored as `store` does, and piece `index + 1`
        of each overwritten input read (None for one not read): the new carry,
        the `ys` and the pieces read.

        The read of a leaf's next piece comes after its new piece is computed,
        and before that piece is written back: unordered, XLA copies the leaf
        whole at every step. It also waits for the write into the leaf two
        before: so one write runs beside one read, and the device holds at most
        one piece more than when reads wait for writes. That leaf goes on from
        the barrier's output: were its written value also used beside the
        barrier, XLA would copy a leaf whole (on the host, for a host leaf)."""
        writer = {o.overwrite: k for k, o in enumerate(self.outputs)}
        ahead = []
        for c, x in enumerate(self.carried):
            k = writer[x.position]
            after = [values[k]] if isinstance(values[k], jax.Array) else []
            before = [c - 2] if c >= 2 else []
            _, olds, fulls[c] = jax.lax.optimization_barrier(
                (after, [fulls[b] for b in before], fulls[c])
            )
            for b, old in zip(before, olds):
                fulls[b] = old
            piece = None
            if self.piece.ins[x.position] in self.used:
                piece = self.read(fulls[c], index + 1, x)
                piece, fulls[c] = jax.lax.optimization_barrier((piece, fulls[c]))
            ahead.append(piece)
            self._write(k, self.outputs[k], values[k], index, fulls, [])
        return (*self.store(index, values, fulls, written=True), ahead)

    def store(
        self, index: Any, values: list, fulls: list, written: bool = False
    ) -> tuple[list, list]:
        """Piece `index`'s `values` written into `fulls` or returned as `ys`
        (not those written into their inputs already, if `written`)."""
        fulls, ys = list(fulls), []
        for k, (out, value) in enumerate(zip(self.outputs, values)):
            if not (written and out.overwrite is not None):
                self._write(k, out, value, index, fulls, ys)
        return fulls, ys

    def _write(
        self, k: int, out: Output, value: Any, index: Any, fulls: list, ys: list
    ) -> None:
        """Output `k`'s piece `value`: added to its sum, written into its input
        (in `fulls`), or appended to `ys` for the scan to stack."""
        cut = self.group.rows, self.group.shards
        if out.summed:
            fulls[self.slot[k]] = fulls[self.slot[k]] + jnp.sum(value)
        elif out.overwrite is None:  # stacked by the scan
            if out.kind is not None:  # a new leaf's piece (of a layer: the leaf)
                value = to_space(_tiling.lower(value, *cut), out.kind, "")
            ys.append(value)
        else:
            c = self.slot[k]
            # The transfer under the leaf's scope, which names it in reports.
            with jax.named_scope(out.label):
                new = _tiling.lower(value, *cut)
                new = new if out.kind is None else to_space(new, out.kind, "")
                fulls[c] = _tiling.write(fulls[c], new, index, *cut)

    def run(self, fulls: list, others: list, read_ahead: bool) -> tuple[list, list]:
        """The loop: the new carry, and the outputs the scan stacks. Its index is
        counted in the carry, so that each slice's offset is affine in the
        loop's counter (module docstring)."""
        pieces = self.group.pieces
        start = jnp.zeros((), jnp.int32)
        # A new host-resident leaf stacked from the pieces by the scan would be
        # joined with the last piece on the host: no read-ahead there.
        stacked_on_host = any(
            o.overwrite is None and o.kind == "pinned_host" for o in self.outputs
        )
        if not read_ahead or stacked_on_host:

            def body(carry: Any, _: Any) -> tuple[Any, list]:
                index, fulls = carry
                values = self.compute(index, others, self.current(fulls, index))
                fulls, ys = self.store(index, values, fulls)
                return (index + 1, fulls), ys

            (_, fulls), ys = jax.lax.scan(body, (start, fulls), length=pieces)
            return fulls, ys

        def ahead_body(carry: Any, _: Any) -> tuple[Any, list]:
            index, now, fulls = carry
            values = self.compute(index, others, now)
            fulls, ys, ahead = self.store_ahead(index, values, list(fulls))
            return (index + 1, ahead, fulls), ys

        # The last piece after the loop: it has no next piece to read.
        first = (start, self.current(fulls, 0), fulls)
        (_, now, fulls), ys = jax.lax.scan(ahead_body, first, length=pieces - 1)
        values = self.compute(pieces - 1, others, now)
        fulls, last = self.store(pieces - 1, values, fulls)
        return fulls, [jnp.concatenate([y, z[None]]) for y, z in zip(ys, last)]

    def collect(self, fulls: list, ys: Iterator) -> list:
        """The value of each output from what the loop gave back: its overwritten
        input or its sum (in the carry), or its stacked pieces."""
        split = int(self.group.shards > 1)  # pieces of each part (`_tiling.parts`)
        values = []
        for k, out in enumerate(self.outputs):
            if k in self.slot:  # summed, or overwritten
                values.append(fulls[self.slot[k]])
            else:
                y = next(ys)
                if out.kind is not None and self.group.rows > 1:  # pieces: one leaf
                    y = jax.lax.collapse(jnp.moveaxis(y, 0, split), 0, 2 + split)
                values.append(y)
        return values


def _slots(outputs: list[Output], carried: list[Input]) -> dict[int, int]:
    """Each output's carry slot (by output index): that of the input it
    overwrites, or after the overwritten inputs, its running sum's."""
    carry = [x.position for x in carried]
    summed = [k for k, o in enumerate(outputs) if o.summed]
    slot = {k: len(carried) + i for i, k in enumerate(summed)}
    written = {k: o.overwrite for k, o in enumerate(outputs) if o.overwrite is not None}
    return slot | {k: carry.index(p) for k, p in written.items()}
