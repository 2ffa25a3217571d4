"""Memory kinds: the names, what the backend has, and where a leaf is now."""

from typing import Any, get_args

import equinox as eqx
import jax
import jax.core
import optax

from . import _paths
from ._custom_types import MemoryKind as MemoryKind, ParamsSpec as ParamsSpec
from ._errors import see


MEMORY_KINDS: tuple[str, ...] = get_args(MemoryKind)


def is_arraylike(x: Any) -> bool:
    """Arrays, tracers and `jax.ShapeDtypeStruct`s: the leaves that hold memory."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def abstract(tree: Any, keep_sharding: bool = True) -> Any:
    """`tree` with every array leaf a `jax.ShapeDtypeStruct` of its sharding, or
    (without `keep_sharding`) device-resident."""

    def struct(x: Any) -> Any:
        sharding = getattr(x, "sharding", None) if keep_sharding else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(lambda x: struct(x) if eqx.is_array(x) else x, tree)


def is_key(x: Any) -> bool:
    """Whether `x` (an array or its abstract value) is an array of PRNG keys."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def is_masked(x: Any) -> bool:
    """`optax.masked`'s holes in an optimizer state: leaves that hold no memory."""
    return isinstance(x, optax.MaskedNode)


def check_kind(kind: Any, where: str) -> None:
    """Raises if `kind` is not one of the three memory kinds."""
    if kind not in MEMORY_KINDS:
        raise ValueError(
            f"{where} is {kind!r}, which is not a memory kind; valid kinds: "
            f"{_paths.quoted(MEMORY_KINDS)}." + see(9)
        )


def backend_kinds() -> tuple[str, ...]:
    """The memory kinds the default backend's devices have."""
    return tuple(m.kind for m in jax.devices()[0].addressable_memories())


def kind_of(x: Any) -> str:
    """The memory kind a leaf is in now. Inside a trace only host vs device is known,
    and host means `"pinned_host"`."""
    if isinstance(x, jax.core.Tracer):
        return "pinned_host" if is_host(x) else "device"
    # A NumPy array (no sharding) goes to the default memory when used.
    return getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"


def abstract_sharding(sharding: Any) -> Any:
    """A sharding for a `jax.ShapeDtypeStruct` that keeps its memory kind when traced.

    JAX 0.10 traces a `ShapeDtypeStruct` whose sharding is a `SingleDeviceSharding`
    in device memory whatever its memory kind (a concrete array with the same
    sharding is traced correctly); a `NamedSharding` over a one-device mesh works.
    """
    if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    mesh = jax.sharding.Mesh(list(sharding.device_set), ("device",))
    spec = jax.sharding.PartitionSpec()
    return jax.sharding.NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)


def is_host(x: Any) -> bool:
    """Whether an array or tracer lives in host memory, as JAX's tracing sees it."""
    return is_host_aval(jax.typeof(x))


def is_host_aval(aval: Any) -> bool:
    """Whether an abstract value (a jaxpr variable's `aval`) is in host memory."""
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def to_space(x: Any, kind: str, path: str) -> Any:
    """`device_put` inside a trace, naming a memory space rather than a device so the
    same traced function serves every backend."""
    if kind == "device":
        return x if not is_host(x) else jax.device_put(x, jax.memory.Space.Device)
    if kind == "pinned_host":
        return x if is_host(x) else jax.device_put(x, jax.memory.Space.Host)
    raise ValueError(
        f"Leaf {path!r} is to live in {kind!r}, which a step cannot return. Use "
        "'pinned_host' instead." + see(44)
    )


def to_device(tree: Any) -> Any:
    """Every array leaf of `tree` on the device: those in host memory moved there."""
    return jax.tree.map(
        lambda x: to_space(x, "device", "") if eqx.is_array(x) else x, tree
    )
