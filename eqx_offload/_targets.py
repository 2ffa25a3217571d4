"""Compile targets for `memory_report`: this backend, or one chip of a TPU, compiled
ahead of time on this machine with libtpu (no TPU needed)."""

import functools
import os
from typing import Any, Literal, TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from . import _paths
from ._memory_kinds import abstract_sharding, kind_of


Target = Literal["tpu-v5e", "tpu-v6e", "tpu-v5p", "tpu-v4"]
# The smallest topology libtpu accepts for each chip ("1x1" is rejected); we compile
# for its first chip.
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

if TYPE_CHECKING:
    TargetArg = Target
else:
    TargetArg = str  # checked by `chip_mesh`, with the valid targets in the message


def _import_libtpu() -> None:
    try:
        import libtpu  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise ImportError(
            "`memory_report(target=...)` compiles for a TPU with libtpu, which is not "
            "installed. Install the `tpu` extra: `pip install 'eqx_offload[tpu]'` "
            "(about 140 MB; Linux x86_64)."
        ) from e


@functools.cache
def chip_mesh(target: str) -> Mesh:
    """A one-device mesh on the first chip of `target`'s smallest topology."""
    if target not in TOPOLOGIES:
        raise ValueError(
            f"`memory_report(target={target!r})`: unknown target; valid targets: "
            f"None (this backend), {_paths.quoted(TOPOLOGIES)}."
        )
    _import_libtpu()
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        # No TPU runtime in this process: keep libtpu from probing for TPU hosts
        # (harmless, but it prints a page of warnings), and from taking the
        # machine-wide lock that would stop a second process compiling meanwhile.
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=TOPOLOGIES[target]
    )
    return Mesh(np.array(topology.devices[:1]), ("chip",), axis_types=(AxisType.Auto,))


def abstract(x: Any, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    """`x` as a `jax.ShapeDtypeStruct` in its memory kind: with its own sharding for
    this backend (`mesh=None`), or on the one chip of `mesh`."""
    if mesh is None:
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not x.committed:
            sharding = None  # placed by the jit, as when the step itself is called
        sharding = None if sharding is None else abstract_sharding(sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    sharding = NamedSharding(mesh, PartitionSpec(), memory_kind=kind_of(x))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
