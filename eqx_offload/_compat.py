"""The private parts of JAX and Equinox that eqx_offload relies on, in one place.

Checked against jax 0.10.2, jaxlib 0.10.2 (libtpu 0.0.42.1) and equinox 0.13.8:
`tests/test_private_jax_api.py` fails, rather than letting a fallback hide it, when
one of them stops working. The compiler's text (HLO, StableHLO, error messages) is
read in `_compiler.py`.
"""

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


JAX_VERSION = "0.10.2"
EQUINOX_VERSION = "0.13.8"


def forward_mode(tree: Any) -> bool:
    """Whether a leaf of `tree` is differentiated in forward mode.

    Forward mode is `jax.jvp` or `jax.jacfwd`, at any depth of the transformations
    around it (inside a `jax.vmap`, say): a leaf is unwrapped transformation by
    transformation (a batched value wraps its value; a differentiated value, its
    primal). A `jax.custom_vjp` cannot run there. Reverse mode (`jax.vjp`,
    `jax.grad`) linearizes with another tracer: JAX's direct linearization, on by
    default since jax 0.7.
    """
    from jax._src.interpreters import ad, batching

    for x in jax.tree.leaves(tree):
        while isinstance(x, (batching.BatchTracer, ad.JVPTracer, ad.LinearizeTracer)):
            if isinstance(x, ad.JVPTracer):
                return True
            x = x.val if isinstance(x, batching.BatchTracer) else x.primal
    return False


def current_trace() -> Any:
    """The trace current here (`jax._src.core.trace_ctx`).

    A value made now belongs to it.
    """
    from jax._src import core

    return core.trace_ctx.trace


def only_batched_since(traces: list[Any]) -> bool:
    """Whether the trace current here is one of `traces`, or `jax.vmap`s over one.

    That is, batching traces all the way down to it. It is not inside a loop, a
    conditional, a `jax.checkpoint` or a `jax.jit` traced since.
    """
    from jax._src.interpreters import batching

    trace = current_trace()
    while trace is not None:
        if any(trace is t for t in traces):
            return True
        if not isinstance(trace, batching.BatchTrace):
            return False
        trace = trace.parent_trace
    return False


def batched(tree: Any) -> bool:
    """Whether `jax.vmap` is the innermost transformation, batching a leaf of `tree`.

    The innermost transformation is the trace current here. `jax.vmap` around a
    gradient (per-example gradients) does not count: its batch is outside the
    differentiation.
    """
    from jax._src.interpreters import batching

    trace = current_trace()
    return isinstance(trace, batching.BatchTrace) and any(
        isinstance(x, batching.BatchTracer) and x._trace is trace
        for x in jax.tree.leaves(tree)
    )


def retype_in_host_memory(x: jax.Array) -> jax.Array:
    """`x`, typed as host memory, without a copy.

    `x` is a host-resident array whose type says device memory. JAX 0.10 builds
    the arrays orbax restores (`make_array_from_single_device_arrays`) with a
    device-memory type, whatever their sharding's memory kind. `jax.jit` traces
    arrays by type. No public function changes an array's type without copying it.

    **Raises:**

    `NotImplementedError` if this JAX no longer allows it (the caller copies).
    """
    try:
        from jax._src import array, core

        host = jax.memory.Space.Host
        aval = core.ShapedArray(x.shape, x.dtype, memory_space=host)
        out = array.ArrayImpl(aval, x.sharding, getattr(x, "_arrays"), committed=True)
    except (ImportError, AttributeError, TypeError) as e:
        raise NotImplementedError(f"{type(e).__name__}: {e}") from e
    if jax.typeof(out).memory_space != host:
        raise NotImplementedError("the new array's type still says device memory")
    return out


def tag_checkpoint_policy(policy: Callable, name: str, value: Any) -> None:
    """Sets the attribute `name` of `policy`, a `jax.checkpoint` policy.

    The `checkpoint` equation keeps the policy as its `policy` parameter. It is a
    function in jax 0.10. In jax 0.11, `save_and_offload_only_these_names` returns
    a frozen dataclass, whose `__setattr__` refuses. Its instance `__dict__` still
    takes the value.
    """
    object.__setattr__(policy, name, value)


class FilterJit(NamedTuple):
    """What an `eqx.filter_jit` function is made of."""

    fun: Callable  # the function it wraps
    # What it donates: 0, its first argument's arrays; 1, those of the others.
    donated: tuple[int, ...]


def filter_jit_parts(fn: Any) -> FilterJit | None:
    """The function inside an `eqx.filter_jit` and its donation, or None.

    Equinox keeps both on its private wrapper, `equinox._jit._JitWrapper`:
    `__wrapped__`, `donate_first`, `donate_rest`. Its public `lower` treats
    `jax.ShapeDtypeStruct`s as static, so it cannot compile abstract arguments.
    """
    fun = getattr(fn, "__wrapped__", None)
    if fun is None or hasattr(fn, "trace") or not hasattr(fn, "lower"):
        return None  # a `jax.jit` function, or no jitted function at all
    donates = (getattr(fn, "donate_first", False), getattr(fn, "donate_rest", False))
    return FilterJit(fun, tuple(i for i, d in enumerate(donates) if d))


def inside_filter_jit(fn: Any) -> Any:
    """`fn`, or the function inside the `eqx.filter_jit`s around it."""
    while (parts := filter_jit_parts(fn)) is not None:
        fn = parts.fun
    return fn


class _KindSharding(NamedSharding):
    """A `NamedSharding` that keeps its memory kind on devices that list no memories.

    JAX's compile-only GPU devices have no `addressable_memories()`: those of
    `jax.experimental.topologies` with the CUDA plugin, jax 0.10.2. A
    `NamedSharding` built on them with `memory_kind="pinned_host"` reads back
    `memory_kind=None`. The argument or output is then compiled into device
    memory, without an error. This subclass answers the kind it was given. Its
    own equality and hash keep jit's cache from returning a device-memory compile
    for it; the C++ equality ignores the subclass.
    """

    _eqx_offload_kind: str

    @property
    def memory_kind(self) -> str:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self._eqx_offload_kind

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, NamedSharding)
            and super().__eq__(other)
            and other.memory_kind == self.memory_kind
        )

    def __hash__(self) -> int:
        return hash((super().__hash__(), self._eqx_offload_kind))


def named_sharding(mesh: Mesh, spec: PartitionSpec, kind: str) -> NamedSharding:
    """`NamedSharding(mesh, spec, memory_kind=kind)`, whose memory kind holds.

    It holds also on compile-only devices that list no memories (`_KindSharding`).

    **Raises:**

    `NotImplementedError` if this JAX no longer lets the kind be kept that way.
    """
    sharding = NamedSharding(mesh, spec, memory_kind=kind)
    if sharding.memory_kind == kind or kind == "device":
        return sharding
    out = _KindSharding(mesh, spec)
    out._eqx_offload_kind = kind
    if out.memory_kind != kind or out == NamedSharding(mesh, spec):
        raise NotImplementedError("a sharding cannot keep its memory kind here")
    return out


# The two forms of JAX's host compute (`jax.experimental.compute_on`): jax 0.10 has
# the context manager `compute_on(compute_type)` and the decorator `compute_on2(f,
# *, compute_type, out_memory_spaces)`; after 0.11.0 the context manager is gone and
# the decorator is called `compute_on`.
HostForm = Literal["decorator", "context"]


def host_forms() -> tuple[str, ...]:
    """The forms of host compute this JAX offers.

    They are `"decorator"` and, up to jax 0.11.0, `"context"`.
    """
    from jax.experimental import compute_on as module

    if hasattr(module, "compute_on2"):
        return ("decorator", "context")
    return ("decorator",) if hasattr(module, "compute_on") else ()


def on_host(
    fn: Callable,
    form: HostForm = "decorator",
    to_device: tuple[bool, ...] | None = None,
) -> Callable:
    """`fn`, run on the host's CPU inside the traced program.

    `fn` takes arrays and returns a list of arrays. This is JAX's
    `compute_on("device_host")`, in `form`. Its arguments must be in host memory:
    the TPU compiler aborts on a device-memory operand aliased to a host result.
    Its results are in host memory too, but those `to_device` marks. The host
    computation writes those to device memory.

    **Raises:**

    `NotImplementedError` naming the forms this JAX has, if it lacks `form`.
    """
    from jax.experimental import compute_on as module

    if form not in host_forms():
        raise NotImplementedError(
            f"jax {jax.__version__} has no {form!r} form of "
            f"`jax.experimental.compute_on`. It has {list(host_forms())}."
        )
    host, device = jax.memory.Space.Host, jax.memory.Space.Device

    def spaces(n: int) -> list:
        return [device if mark else host for mark in to_device or (False,) * n]

    def typed(*args: Any) -> list:
        # JAX 0.10 types the arrays made afresh inside (`zeros_like`, a broadcast
        # literal) as device memory, and refuses to combine them with host values
        # ("memory_space of all inputs passed to `add` must be the same"). Typed
        # as device memory inside, every value is alike; the host computes and
        # moves the same.
        outs = fn(*[jax.device_put(x, device) for x in args])
        places = spaces(len(outs))
        return [jax.device_put(x, s) for x, s in zip(outs, places, strict=True)]

    if form == "context":

        def in_context(*args: Any) -> Any:
            with module.compute_on("device_host"):
                return jax.jit(typed)(*args)

        return in_context

    def decorated(*args: Any) -> Any:
        # (How many results: given, else traced once more to count them.)
        n = len(to_device) if to_device else len(jax.eval_shape(typed, *args))
        decorator: Any = getattr(module, "compute_on2", None) or module.compute_on
        on = decorator(typed, compute_type="device_host", out_memory_spaces=spaces(n))
        return on(*args)

    return decorated
