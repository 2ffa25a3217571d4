"""Why a compiler rejected an offloaded step.

Each host-resident leaf the step streams is compiled alone, the way the step
moves it. The ones the compiler cannot stream are named, with a policy that keeps
them on the device.

XLA's TPU compiler picks the tiled layout of each array from its shape. For some
shapes, its host-offload passes cannot slice the layout it picked. This holds even
in a hand-written scan. Examples: a layer of `(4, 97, 97)` floats, `(layers, 388,
97)` weights.
`_tiling.py` has the rules the library follows ahead of time. Such a leaf works
when it and its optimizer state stay on the device.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat, _compiler, _paths, _tiling
from ._errors import see
from ._memory_kinds import ParamsSpec


# The other way out of a rejection.
_WHOLE_UPDATE = (
    "If the operation it names is in the optimizer update, not the forward or "
    "backward pass, update whole leaves instead: `Policy(update='whole')`."
)


class DoesNotCompile(ValueError):
    """Raised when the compiler rejects an offloaded step.

    `memory_report` raises it, and so does a `train_step` compiled on a TPU. The
    message names the host-resident leaves the compiler could not stream. It also
    gives a policy that keeps them on the device.
    """


def out_of_memory(e: RuntimeError) -> bool:
    """Whether a `jax.errors.JaxRuntimeError` says the program ran out of memory.

    Running out of memory means the program does not fit. It is not a rejection.
    """
    return getattr(e, "error_code_string", None) == "RESOURCE_EXHAUSTED"


class Streamed(NamedTuple):
    """A host-resident leaf as the step streams it."""

    path: str  # the parameter's path (for a state leaf: the parameter it mirrors)
    shape: tuple[int, ...]
    dtype: Any
    rows: int  # rows per slice along axis 0
    gradient: bool  # also sliced in the forward pass, its gradient written back


def _probe(leaf: Streamed, mesh: Mesh) -> str | None:
    """The compiler's message if it rejects streaming `leaf` as the step does.

    The probe is a scan compiled on `mesh`. None if it compiles.
    """
    # Compile-only GPU devices list no memories: a plain `NamedSharding` would
    # silently put `w` in device memory (`_compat.named_sharding`).
    host = _compat.named_sharding(mesh, PartitionSpec(), "pinned_host")
    device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
    w = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=host)
    x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=device)
    rows, n = leaf.rows, leaf.shape[0] // leaf.rows
    Device, Host = jax.memory.Space.Device, jax.memory.Space.Host

    def update(w: Any, g: Any) -> Any:
        def body(w: Any, i: Any) -> tuple[Any, None]:
            def piece(x: Any) -> Any:
                on_device = jax.device_put(_tiling.read(x, i, rows), Device)
                return _tiling.lift(on_device, rows)

            new = jax.device_put(_tiling.lower(piece(w) - piece(g), rows), Host)
            return _tiling.write(w, new, i, rows), None

        return jax.lax.scan(body, w, jnp.arange(n))[0]

    def step(w: Any, x: Any) -> Any:
        def loss(w: Any) -> Any:
            def body(c: Any, layer: Any) -> tuple[Any, None]:
                layer = jax.device_put(layer, Device)
                return c * jnp.mean(layer.astype(jnp.float32)) + 1.0, None

            return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, w)[0])

        return update(w, jax.device_put(jax.grad(loss)(w), Host))

    def state(w: Any) -> Any:
        return update(w, jax.device_put(jnp.ones(leaf.shape, leaf.dtype), Host))

    fn, args = (step, (w, x)) if leaf.gradient else (state, (w,))
    traced = jax.jit(fn, donate_argnums=0).trace(*args)
    try:
        traced.lower().compile()
    # XLA's rejections are `JaxRuntimeError`s; JAX's lowering of memory kinds raises
    # `ValueError`/`NotImplementedError`. Our own bugs (in tracing) propagate.
    except (jax.errors.JaxRuntimeError, ValueError, NotImplementedError) as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


_cache: dict[tuple, str | None] = {}


def rejected(leaves: Sequence[Streamed], mesh: Mesh) -> list[tuple[Streamed, str]]:
    """The leaves whose streaming the compiler for `mesh` rejects, cached per shape.

    A leaf whose probe fails for a reason of its own is left out. The diagnosis
    explains a rejection; it never replaces the compiler's error with its own.
    """
    out = []
    for leaf in leaves:
        key = (tuple(d.device_kind for d in mesh.devices.flat), leaf[1:])
        if key not in _cache:
            try:
                _cache[key] = _probe(leaf, mesh)
            except Exception:  # the probe's own failure: no verdict, not kept
                continue
        if _cache[key] is not None:
            out.append((leaf, _cache[key]))
    return out


def way_out(params: ParamsSpec, opt_state: ParamsSpec, paths: list[str]) -> str:
    """The `Policy` fields that keep `paths` and their state on the device.

    They are written as the user would write them.
    """

    def with_device(spec: ParamsSpec) -> dict[str, str]:
        items = {"**": spec} if isinstance(spec, str) else dict(spec or {})
        return items | {p: "device" for p in paths}

    return f"`params={with_device(params)!r}, opt_state={with_device(opt_state)!r}`"


def leaves_in_message(message: str, leaves: Sequence[Streamed]) -> list[str]:
    """The paths of the leaves a compiler message points at, in the leaves' order.

    A leaf is pointed at by name in the message's `op_name`s. The streamed update
    tags each leaf's slices and transfers with `jax.named_scope`. A leaf is also
    pointed at by a shape of two dimensions or more (`_compiler.array_shapes`).
    That shape is the whole leaf, one layer of a stacked leaf, or one of its pieces.
    """
    names = " ".join(_compiler.op_names(message))
    # Matrices and larger: a vector or scalar in a message is no leaf's own.
    shapes = {s for _, s in _compiler.array_shapes(message) if len(s) >= 2}

    def quoted(leaf: Streamed) -> bool:
        piece = (leaf.rows, *leaf.shape[1:])
        layer = leaf.shape[1:] if leaf.rows == 1 and len(leaf.shape) >= 3 else None
        return bool({leaf.shape, piece, layer} & shapes)

    found = [x.path for x in leaves if x.path and (x.path in names or quoted(x))]
    return list(dict.fromkeys(found))


def explain(
    what: str,
    message: str,
    leaves: Sequence[Streamed],
    mesh: Mesh,
    params: ParamsSpec,
    opt_state: ParamsSpec,
) -> str:
    """The error text for a step the compiler rejected.

    It names the leaves that fail alone, and a way out. If none does, it names
    the leaves the compiler's message points at.
    """
    # A parameter's first rejection (or its state's).
    first = {leaf.path: (leaf, reason) for leaf, reason in rejected(leaves, mesh)}
    if first:
        return "\n".join(
            [
                f"{what}: the compiler rejected it ({_first_line(message)}). Compiled "
                "alone, streaming these host-resident leaves from the host fails:",
                *(
                    f"  - {leaf.path!r} ({jnp.dtype(leaf.dtype).name}"
                    f"{list(leaf.shape)}): {reason}"
                    for leaf, reason in first.values()
                ),
                "Keep them and their optimizer state on the device: in the `Policy`, "
                f"{way_out(params, opt_state, list(first))}." + see(54),
            ]
        )
    named = leaves_in_message(message, leaves)
    if named:
        keep = (
            f"Its message points at {_paths.quoted(named)}, which no probe of one "
            "leaf alone rejects. Keep them and their optimizer state on the "
            f"device: in the `Policy`, {way_out(params, opt_state, named)}."
        )
    else:
        keep = (
            "No single host-resident leaf fails alone. Keep the leaves it is about "
            "on the device: `Policy(params={..., path: 'device'}, "
            "opt_state={..., path: 'device'})`."
        )
    return (
        f"{what}: the compiler rejected it: {_first_line(message).rstrip('.')}. "
        f"{keep} {_WHOLE_UPDATE}" + see(54)
    )


def _first_line(message: str, limit: int = 400) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[:limit] + " ..."
