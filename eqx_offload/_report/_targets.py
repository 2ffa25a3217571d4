"""Compile targets for `memory_report`: this backend, one chip of a TPU, or a whole
TPU slice, compiled ahead of time on this machine with libtpu (no TPU needed)."""

import functools
import os
import re
from collections import Counter
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .. import _paths
from .._memory_kinds import abstract_sharding, kind_of


# The chips, and the smallest topology libtpu accepts for each ("1x1" is rejected):
# a one-chip target compiles for its first chip.
TOPOLOGIES = {
    "tpu-v5e": "v5e:2x2",
    "tpu-v6e": "v6e:2x2",
    "tpu-v5p": "v5p:2x2x1",
    "tpu-v4": "v4:2x2x1",
}

# The device memory (HBM) the compiler lets one program use on one chip (one
# device of the topology), as libtpu 0.0.42 states it when a program is too big
# ("exceeds available HBM (15.75G)"): a little under the nominal 16, 32 and 95 GiB
# of v5e, v6e and v5p; a `tpu-v4` device is one TensorCore's half of its chip.
HBM_BYTES = {
    "tpu-v5e": int(15.75 * 2**30),
    "tpu-v6e": int(31.25 * 2**30),
    "tpu-v5p": int(95.74 * 2**30),
    "tpu-v4": int(15.25 * 2**30),
}

# A target is a chip name, or a chip name and a slice's topology: "tpu-v5e:4x4".
# Checked by `parse`, with the valid forms in the message (a `Literal` cannot spell
# the topologies).
_TARGET = re.compile(r"(?P<chip>[\w-]+?)(?::(?P<topology>\d+(?:x\d+)+))?")
_FORMS = (
    f"None (this backend), {_paths.quoted(TOPOLOGIES)} (one chip), or a whole slice "
    "as chip and topology, e.g. 'tpu-v5e:2x2' ... 'tpu-v5e:16x16', 'tpu-v6e:4x4', "
    "'tpu-v5p:2x2x2', 'tpu-v4:2x2x2'"
)


def parse(target: str) -> tuple[str, str | None]:
    """The chip and the slice topology of `target`: `("tpu-v5e", "4x4")` for
    `"tpu-v5e:4x4"`, `("tpu-v5e", None)` for one chip."""
    found = _TARGET.fullmatch(target) if isinstance(target, str) else None
    if found is None or found["chip"] not in TOPOLOGIES:
        raise ValueError(
            f"`memory_report(target={target!r})`: unknown target; valid targets: "
            f"{_FORMS}."
        )
    return found["chip"], found["topology"]


def _import_libtpu() -> None:
    try:
        import libtpu  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise ImportError(
            "`memory_report(target=...)` compiles for a TPU with libtpu, which is not "
            f"installed. Install it: `pip install 'jax[tpu]=={jax.__version__}'` (the "
            "libtpu of this JAX, about 140 MB; Linux x86_64), or from a clone of "
            "eqx_offload, its `tpu` extra: `pip install -e '.[tpu]'`. On a machine "
            "without TPUs, run with `JAX_PLATFORMS=cpu`."
        ) from e


@functools.cache
def _topology_devices(name: str) -> tuple[Any, ...]:
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # No TPU runtime in this process: keep libtpu from probing for TPU hosts
        # (harmless, but it prints a page of warnings), and from taking the
        # machine-wide lock that would stop a second process compiling meanwhile.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=name)
    return tuple(desc.devices)


def devices(target: str) -> tuple[Any, ...]:
    """The TPU devices `target` compiles for: every device of a slice, or the first
    chip of the smallest topology."""
    chip, topology = parse(target)
    _import_libtpu()
    if topology is None:
        return _topology_devices(TOPOLOGIES[chip])[:1]
    name = f"{chip.removeprefix('tpu-')}:{topology}"
    try:
        return _topology_devices(name)
    except jax.errors.JaxRuntimeError as e:
        message = str(e).strip().removeprefix("INVALID_ARGUMENT: ").rstrip(".")
        raise ValueError(
            f"`memory_report(target={target!r})`: libtpu does not accept the "
            f"topology {name!r}: {message}. Use a topology of whole hosts it accepts "
            f"(for {chip}: e.g. '{chip}:2x2', '{chip}:4x4'), or {chip!r} for one "
            f"chip; valid targets: {_FORMS}."
        ) from e


def chips_per_host(target: str) -> int:
    """How many of `target`'s devices one host (one process) serves, as libtpu lays
    the slice out (`device.process_index`); 1 for a one-chip target."""
    return max(Counter(d.process_index for d in devices(target)).values())


@functools.cache
def chip_mesh(target: str) -> Mesh:
    """A one-device mesh on the first chip of `target`."""
    return Mesh(np.array(devices(target)[:1]), ("chip",), axis_types=(AxisType.Auto,))


def slice_mesh(target: str, like: Mesh | AbstractMesh | None) -> Mesh:
    """A mesh over every device of slice `target`: with the axis names, sizes and
    types of `like` (the mesh the inputs are laid out on), or one `Auto` axis
    `"chips"`. A `like` of another size is a `ValueError` saying so."""
    if like is None:
        return _slice_mesh(target, (len(devices(target)),), ("chips",), None)
    if like.size != len(devices(target)):
        raise ValueError(
            f"`memory_report(target={target!r})`: the inputs are laid out on a mesh "
            f"of shape {dict(like.shape)} ({like.size} devices), but {target} has "
            f"{len(devices(target))} chips. Lay them out on a mesh of "
            f"{len(devices(target))} devices (e.g. `AbstractMesh(("
            f"{len(devices(target))},), ('fsdp',))`), or choose the slice of "
            f"{like.size} chips."
        )
    sizes = tuple(like.shape.values())
    return _slice_mesh(target, sizes, tuple(like.axis_names), tuple(like.axis_types))


@functools.cache
def _slice_mesh(
    target: str, sizes: tuple[int, ...], names: tuple[str, ...], types: Any
) -> Mesh:
    all_devices = devices(target)
    try:
        # As `jax.make_mesh` lays a mesh on the chips' physical links.
        grid = mesh_utils.create_device_mesh(sizes, devices=list(all_devices))
    except (AssertionError, NotImplementedError, ValueError):
        # (shapes it cannot map onto the torus, and `tpu-v4`'s two cores per chip)
        grid = np.array(all_devices).reshape(sizes)
    if types is None:
        types = (AxisType.Auto,) * len(sizes)
    return Mesh(grid, names, axis_types=types)


def abstract(
    x: Any, mesh: Mesh | None, source: Any = None, replicate: bool = True
) -> jax.ShapeDtypeStruct:
    """`x` as a `jax.ShapeDtypeStruct` in its memory kind.

    - `mesh=None`: with its own sharding, for this backend.
    - `mesh`: a TPU mesh. A leaf laid out on `source` (the inputs' mesh, of the same
        axis names and sizes) keeps its spec on `mesh`; any other leaf is replicated
        over `mesh`, or, with `replicate=False`, left without a sharding (for
        `Policy(batch=...)` to lay out).
    """
    if mesh is None:
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not x.committed:
            sharding = None  # placed by the jit, as when the step itself is called
        sharding = None if sharding is None else abstract_sharding(sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        if source is not None and sharding.mesh == source:
            named = NamedSharding(mesh, sharding.spec, memory_kind=kind_of(x))
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named)
    elif mesh.size > 1 and sharding is not None and len(sharding.device_set) > 1:
        raise ValueError(
            f"`memory_report(target=...)`: an argument of shape {tuple(x.shape)} is "
            f"laid out with a {type(sharding).__name__}; lay it out with a "
            "`NamedSharding` over a mesh, so that its layout can be carried over to "
            "the slice."
        )
    if not replicate:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    named = NamedSharding(mesh, PartitionSpec(), memory_kind=kind_of(x))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named)
