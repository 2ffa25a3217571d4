"""The check that `filter_offload` runs on a traced function: host-resident
stacked leaves are used only inside the scans that bring them to the device a layer
at a time, and the host tables of `Policy(host_tables=...)` only by the functions
that read them by blocks of rows.

An adapter: it walks the function's jaxpr, following each watched value.
"""

import re
from typing import Any, NamedTuple

import jax

from . import _jaxpr, _paths, _scopes, _tiling
from ._errors import see
from ._memory_kinds import is_host, is_host_aval


class Argument(NamedTuple):
    """One argument of the wrapped function: its position or keyword, and value."""

    key: int | str
    value: Any

    @property
    def name(self) -> str:
        """How messages name it: "argument 0", "argument `mask`"."""
        key = self.key if isinstance(self.key, int) else f"`{self.key}`"
        return f"argument {key}"

    @property
    def is_model(self) -> bool:
        """Whether it is the model, the first argument, which `Policy` describes."""
        return self.key == 0


def arguments(args: tuple, kwargs: dict) -> list[Argument]:
    """The arguments in the order `jax.tree.flatten((args, kwargs))` visits them."""
    return [Argument(i, a) for i, a in enumerate(args)] + [
        Argument(k, kwargs[k]) for k in sorted(kwargs)
    ]


def check(
    jaxpr: Any, positions: list[int], args: tuple, kwargs: dict, tables: set[str]
) -> None:
    """Raises unless host-resident stacked leaves are only used inside their scans,
    and the model's host `tables` only by the functions that read them by blocks.
    `jaxpr` is traced on the array leaves of the arguments, at `positions` among
    their flattened leaves."""
    info = [
        (a, leaf) for a in arguments(args, kwargs) for leaf in _paths.leaves(a.value)
    ]
    watched = {}
    for var, i in zip(jaxpr.invars, positions):
        argument, leaf = info[i]
        table = argument.is_model and leaf.path in tables
        if (leaf.stacked is not None or table) and is_host(leaf.value):
            watched[var] = _Watched(argument.name, leaf, False, table)
    _Walk(watched).run(jaxpr)


class _Watched(NamedTuple):
    """A host-resident stacked leaf as it flows through a jaxpr."""

    argument: str  # how messages name the argument holding it
    leaf: _paths.Leaf
    is_slice: bool  # one layer's slice, inside a scan over the whole leaf
    host_table: bool = False  # in `Policy(host_tables=...)`, or one `embed` gave


class _Walk:
    """A walk through one jaxpr after operations that compute on a watched value:
    the first one found raises (`_misuse_error`).

    `watched` starts as the jaxpr's inputs and grows with the values an equation
    hands them on to (a slice read ahead, a table `embed` returns); the caller's
    mapping is copied, never changed.
    """

    def __init__(self, watched: dict[Any, _Watched], reading: bool = False):
        self.watched = dict(watched)
        self.reading = reading  # inside a scan's read of one layer
        self.consumed: set[Any] = set()  # host tables read by blocks already

    def run(self, jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            used = {
                i: self.watched[v]
                for i, v in enumerate(eqn.invars)
                if not _jaxpr.is_literal(v) and v in self.watched
            }
            if used:
                self._equation(eqn, used)

    def _equation(self, eqn: Any, used: dict[int, _Watched]) -> None:
        # The scopes `eqn` was traced under: the whole names in its name stack
        # (`a/scope/b`, `transpose(jvp(scope))`).
        scopes = re.split(r"[/()]", str(eqn.source_info.name_stack))
        if all(w.host_table for w in used.values()) and _scopes.VOCAB_BLOCKS in scopes:
            self._read_by_blocks(eqn, used)
        elif _jaxpr.is_device_put(eqn):
            _device_put(eqn, used)
        elif self._reads_ahead(eqn, used):
            # A layer read ahead by a prefetching scan (`_prefetch._at`, a
            # `custom_vmap` slice): like a slice the scan takes, it may only be
            # moved to the device.
            self.watched[eqn.outvars[0]] = used[0]._replace(is_slice=True)
        elif (subs := _jaxpr.sub_jaxprs(eqn)) is None:
            raise _misuse_error(next(iter(used.values())), _jaxpr.primitive_name(eqn))
        else:
            self._calls(eqn, used, subs)

    def _read_by_blocks(self, eqn: Any, used: dict[int, _Watched]) -> None:
        """`embed` / `chunked_cross_entropy` reading a host table by blocks. Each
        table is read by one of them: two would sum two host gradients."""
        for i, w in used.items():
            if eqn.invars[i] in self.consumed:
                raise _misuse_error(w, "twice")
            self.consumed.add(eqn.invars[i])
        for out in eqn.outvars:  # the table `embed` hands on
            if is_host_aval(out.aval) and getattr(out.aval, "ndim", 0) == 2:
                self.watched[out] = next(iter(used.values()))

    def _reads_ahead(self, eqn: Any, used: dict[int, _Watched]) -> bool:
        if not self.reading or set(used) != {0}:
            return False
        return _jaxpr.is_dynamic_slice(eqn) or (
            used[0].is_slice and _jaxpr.is_squeeze(eqn)
        )

    def _calls(self, eqn: Any, used: dict[int, _Watched], subs: list) -> None:
        """Walks each jaxpr `eqn` calls, with the watched values it passes in."""
        for sub, operands, sliced in subs:
            inner = {
                sub.invars[k]: used[i]._replace(is_slice=True) if sliced else used[i]
                for i, k in operands.items()
                if i in used
            }
            walk = _Walk(inner, self.reading or _jaxpr.is_custom_vmap(eqn))
            if inner:
                walk.run(sub)
            if not sliced and len(sub.outvars) == len(eqn.outvars):
                # A call that returns a watched value as it is (a gradient tap of
                # the same dtype, an inner `jax.jit`) hands it on.
                for inner_out, out in zip(sub.outvars, eqn.outvars):
                    if _jaxpr.is_literal(inner_out):  # a constant output
                        continue
                    w = walk.watched.get(inner_out)
                    if w is not None and (w.host_table or w.is_slice):
                        self.watched[out] = w


def _device_put(eqn: Any, used: dict[int, _Watched]) -> None:
    """A watched value may be moved to the device: a slice inside the scan, or
    (for a leaf the TPU compiler cannot slice on the host) the whole leaf, moved
    by the scan."""
    destinations = _jaxpr.device_put_destinations(eqn)
    for i, w in used.items():
        whole_ok = not _tiling.slices_by_layer(w.leaf.value.shape)
        if not (w.is_slice or whole_ok) or destinations[i] != jax.memory.Space.Device:
            raise _misuse_error(w, "device_put")


def _misuse_error(w: _Watched, primitive: str) -> ValueError:
    """The error for `primitive` computing on `w` ("twice": a host table read
    twice)."""
    path, argument = w.leaf.path, w.argument
    if w.host_table and primitive == "twice":
        return ValueError(
            f"`filter_offload`: the host table {path!r} of {argument} is read by two "
            "of `eo.embed` / `eo.chunked_cross_entropy`. For a tied embedding, pass "
            "the table `eo.embed` returns to the head." + see(99)
        )
    if w.host_table:
        return ValueError(
            f"`filter_offload`: leaf {path!r} of {argument} is a host table, computed "
            f"on by `{primitive}`. Let only `eo.embed` and "
            "`eo.chunked_cross_entropy` read it, or drop it from `host_tables`."
            + see(99)
        )
    keep = "Policy(params='device')"
    if w.leaf.stacked:
        keep = f"Policy(params={{{w.leaf.stacked!r}: 'device'}})"
    return ValueError(
        f"`filter_offload`: leaf {path!r} of {argument} is a host-resident layer of "
        f"the `Stacked` at {w.leaf.stacked!r}, computed on outside its scan (by "
        f"`{primitive}`). Compute it inside the layers (for weight decay, "
        f"`optax.add_decayed_weights`), or keep it on the device: `{keep}`." + see(33)
    )
