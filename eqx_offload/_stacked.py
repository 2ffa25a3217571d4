"""`Stacked`: N structurally identical layers applied in order with `lax.scan`."""

import abc
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

from . import _checkpoint_name_log, _layout, _paths, _pending, _tiling
from ._errors import see
from ._memory_kinds import is_arraylike, is_host, to_device
from ._warn import warn_at_caller


_Layer = TypeVar("_Layer")
_Carry = TypeVar("_Carry")


class AbstractScan(eqx.Module):
    """How a `Stacked` configured by `filter_offload` scans its layers.

    This is the transform's scan body, kept out of the container. Its only
    implementation is `_scan_body.ScanConfig`. It is a static field of the
    configured view: hashable, and part of the treedef every trace cache keys on.
    """

    path: eqx.AbstractVar[str]

    @abc.abstractmethod
    def scan(
        self, f: Callable, carry: Any, dynamic: Any, static: Any, xs: Any, length: int
    ) -> tuple[Any, Any]:
        """`jax.lax.scan` of `f` over the layers, with the policy applied.

        `dynamic` are the layers' arrays. Each host slice goes to the device as its
        layer is reached.
        """

    @abc.abstractmethod
    def check_slice(self, layers: Any, how: str) -> None:
        """Raises if `stacked[i:j]` cannot be taken inside the step."""

    @abc.abstractmethod
    def check_bypass(self, layers: Any, how: str) -> None:
        """Raises, or warns, when a layer is taken out of the scan (`stacked[i]`)."""


class Stacked(_paths.AbstractLayerStack, Generic[_Layer]):
    """N structurally identical layers, applied in order with `jax.lax.scan`.

    The layers are stored as one layer whose array leaves have a leading axis of
    size N. Scanning keeps compile time independent of depth. It also lets
    `filter_offload` move one layer's parameters to the device at a time. A Python
    loop over layers would keep all of them there. The layer axis is axis 0. XLA
    offloads parameters only when scanning over axis 0.

    Outside `filter_offload`, this is a plain `lax.scan`. Host-resident layers are
    still moved to the device one at a time, with a warning. Run a host-resident
    model with `eqx.filter_jit(eo.filter_offload(fn, policy))`, as the how-to
    "Evaluate and sample" shows.

    Inside `filter_offload`, the transform substitutes a configured view, itself a
    `Stacked`. The view names the carry entering each layer `"<path>.input"`, and
    applies the policy's `jax.checkpoint`.

    **Arguments:**

    - `layers`: one layer whose array leaves all have the same leading (layer)
        axis. Usually built with `Stacked.from_fn` or `Stacked.from_layers`.
    - `pending`: set by a `Policy(update_timing="next_forward")` step on the
        `Stacked`s whose update it left pending, cleared by
        `eqx_offload.apply_pending`. Such a `Stacked` refuses to run. (The step
        that applies its update runs it unmarked.)

    !!! Example

        ```python
        blocks = eo.Stacked.from_fn(lambda k: Block(dim, key=k), 24, key=key)
        x = blocks(x)              # layer 0, then 1, ... 23
        len(blocks), blocks[0]     # 24, the first layer as a `Block`
        ```
    """

    layers: _Layer
    pending: bool = eqx.field(static=True, repr=False, default=False)
    # Private: the configuration `filter_offload` gives its view.
    _scan: "AbstractScan | None" = eqx.field(static=True, repr=False, default=None)

    def __check_init__(self):
        if self._scan is not None:
            # A configured view: its layers were checked when the user built them,
            # and the view of one half of an `eqx.partition`ed model holds no arrays.
            return
        sizes = [
            (leaf.path, leaf.value.shape[0] if leaf.value.ndim else None)
            for leaf in _paths.leaves(self.layers)
            if is_arraylike(leaf.value)
        ]
        if not sizes:
            raise ValueError(
                "`Stacked(layers)` needs at least one array leaf to count its layers."
            )
        first_path, n = sizes[0]
        if n == 0:
            raise ValueError(
                f"`Stacked(layers)` has no layers: leaf {first_path!r} has leading "
                "axis 0. Skip applying an empty range of layers." + see(6)
            )
        for path, size in sizes:
            if size != n:  # (None: a leaf without axes)
                raise ValueError(
                    f"`Stacked(layers)`: leaf {path!r} has leading axis {size} but "
                    f"{first_path!r} has {n}. Build it with `Stacked.from_fn` or "
                    "`Stacked.from_layers`." + see(3)
                )

    @classmethod
    def from_fn(
        cls, make_layer: Callable[[PRNGKeyArray], _Layer], n: int, *, key: PRNGKeyArray
    ) -> "Stacked[_Layer]":
        """Builds `n` layers with `make_layer(key_i)`, vmapped over split keys.

        **Arguments:**

        - `make_layer`: a function from a PRNG key to one layer (an `eqx.Module`).
            Its non-array fields must not depend on the key.
        - `n`: the number of layers.
        - `key`: split into `n` keys, one per layer.

        **Returns:**

        A `Stacked` whose array leaves have a leading axis of size `n`.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(
                f"`Stacked.from_fn(n=...)` must be a positive int, got {n!r}." + see(4)
            )
        return cls(eqx.filter_vmap(make_layer)(jax.random.split(key, n)))

    @classmethod
    def from_layers(cls, layers: Sequence[_Layer]) -> "Stacked[_Layer]":
        """Stacks existing layers of one structure, shape and dtype per leaf.

        Their non-array fields must be equal too.

        **Arguments:**

        - `layers`: a non-empty sequence of layers.

        **Returns:**

        A `Stacked` of `len(layers)` layers, in order.

        **Raises:**

        `ValueError` naming the first leaf whose structure, shape or dtype differs.
        """
        layers = list(layers)
        if not layers:
            raise ValueError(
                "`Stacked.from_layers(layers)` needs at least one layer." + see(2)
            )
        for i, layer in enumerate(layers[1:], start=1):
            _check_same_layer(layers[0], layer, i)

        def stack(*xs: Any) -> Any:
            if not is_arraylike(xs[0]):
                return xs[0]
            if isinstance(xs[0], jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((len(xs),) + xs[0].shape, xs[0].dtype)
            return jnp.stack(xs)

        return cls(jtu.tree_map(stack, *layers))

    def __len__(self) -> int:
        # (`__check_init__` requires an array leaf.)
        return next(x.shape[0] for x in jtu.tree_leaves(self.layers) if is_arraylike(x))

    def __getitem__(self, index: int | slice) -> Any:
        """`stacked[i]` is layer `i`, an instance of the layer's class.

        `stacked[i:j]` is a `Stacked` of those layers.
        """
        if isinstance(index, slice):
            n = len(self)
            how = f"`{self._where()}[{_slice_text(index)}]`"
            if not range(n)[index]:
                raise IndexError(
                    f"{how} selects no layers of {n}. Skip applying an empty range."
                    + see(5)
                )
            if self._scan is not None:
                self._scan.check_slice(self.layers, how)
            layers = map_arrays(lambda x: x[index], self.layers)
            return Stacked(layers, pending=self.pending, _scan=self._scan)
        return self._layer(index, f"`{self._where()}[{index}]`")

    def __iter__(self) -> Iterator[_Layer]:
        """The layers, one at a time, each an instance of the layer's class.

        Inside `filter_offload` and `train_step`, iterating bypasses the scan.
        Host-resident layers are then an error. Under a policy that asks for
        rematerialisation or offloading, a warning says that none applies.
        """
        how = f"`for layer in {self._where()}`"
        return (self._layer(i, how) for i in range(len(self)))

    def _where(self) -> str:
        return "stacked" if self._scan is None else (self._scan.path or "stacked")

    def _layer(self, index: int, how: str) -> Any:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"{how}: layer index out of range for {n} layers.")
        if self._scan is not None:
            self._scan.check_bypass(self.layers, how)
        return map_arrays(lambda x: x[index % n], self.layers)

    def __call__(
        self, x: PyTree, *args: Any, key: PRNGKeyArray | None = None, **kwargs: Any
    ) -> PyTree:
        """Applies the layers in order: `x = layer(x, *args, **kwargs)` for each.

        **Arguments:**

        - `x`: the carry, an array or pytree. Each layer returns one of the same
            structure, shapes and dtypes.
        - `*args`, `**kwargs`: passed unchanged to every layer (e.g. a mask).
        - `key`: if given, split into one key per layer with
            `jax.random.split(key, n)`. Each is passed as `key=`, e.g. for
            `eqx.nn.Dropout`. A per-layer loop that chains
            `key, k = jax.random.split(key)` draws other keys. To keep its chain,
            carry the key through `scan`. The concepts page shows how ("Dropout
            keys when porting a loop").

        **Returns:**

        The output of the last layer.
        """

        def apply(layer: Any, carry: PyTree, layer_key: PRNGKeyArray | None) -> tuple:
            keys = {} if layer_key is None else {"key": layer_key}
            out = layer(carry, *args, **keys, **kwargs)
            _check_carry(carry, out)
            return out, None

        keys = None if key is None else jax.random.split(key, len(self))
        return self.scan(apply, x, keys)[0]

    def scan(
        self,
        f: Callable[[_Layer, _Carry, Any], tuple[_Carry, Any]],
        carry: _Carry,
        xs: PyTree = None,
    ) -> tuple[_Carry, PyTree]:
        """The general form, as `jax.lax.scan`: `carry, y = f(layer, carry, x)`.

        `f` runs for each layer, with the matching slice `x` of `xs`.

        **Arguments:**

        - `f`: `f(layer, carry, x) -> (carry, y)`.
        - `carry`: the initial carry.
        - `xs`: per-layer inputs with a leading axis of size `len(self)` (e.g.
            `jax.random.split(key, len(stacked))`), or `None`.

        **Returns:**

        `(carry, ys)`: the final carry and the stacked `y`s.
        """
        if self.pending:  # its weights are one update behind (`train_step` unmarks)
            _pending.refuse(self._where())
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        dynamic = jtu.tree_map(whole_to_device, dynamic)
        if self._scan is not None:
            return self._scan.scan(f, carry, dynamic, static, xs, len(self))
        if _checkpoint_name_log.is_inside():
            raise ValueError(
                "A `Stacked` inside a `filter_offload` function is not configured: "
                "it was closed over, or rebuilt inside the function. "
                "Pass the model (every half of an `eqx.partition`ed model) as "
                "arguments: `filter_offload(loss_fn, policy)(model, *batch)`." + see(31)
            )
        _warn_host_outside(self.layers)

        def body(carry: Any, inputs: Any) -> Any:
            layer_arrays, x = inputs
            new, y = f(eqx.combine(to_device(layer_arrays), static), carry, x)
            return keep_carry_sharding(new, carry), y

        return jax.lax.scan(body, carry, (dynamic, xs), length=len(self))


def _warn_host_outside(layers: Any) -> None:
    """Warns when a `Stacked` with host-resident layers runs outside `filter_offload`.

    It works: its scan moves them to the device one layer at a time. But it is
    usually a host-resident model run outside the step. No policy applies to it,
    and its other host-resident leaves cannot be computed on there.
    """
    host = array_paths(layers, host=True)
    if host:
        warn_at_caller(
            f"A `Stacked` whose layers are host-resident ({_paths.quoted(host, 3)}) "
            "is applied outside `filter_offload`, so no `Policy` applies. "
            "Its scan moves one layer at a time to the device, without "
            "`jax.checkpoint` or offloading, and the model's other host-resident "
            "leaves cannot be computed on here. To evaluate or sample, call the model "
            "inside `eqx.filter_jit(eo.filter_offload(fn, policy))`. If it fits, put "
            "it on the device with `eo.place(model, eo.Policy(params='device'))`."
            + see(106)
        )


def array_paths(tree: Any, prefix: str = "", host: bool = False) -> list[str]:
    """The dotted paths (continuing `prefix`) of the array leaves of `tree`, in
    `jax.tree.leaves` order; with `host`, only of the host-resident ones."""
    return [
        _paths.join(prefix, leaf.path)
        for leaf in _paths.leaves(tree)
        if eqx.is_array(leaf.value) and (is_host(leaf.value) or not host)
    ]


def _check_carry(carry: PyTree, out: PyTree) -> None:
    """Raises unless a layer returned a carry like the one it took.

    A layer returning `(x, cache)` is the usual mistake.
    """
    same = jtu.tree_structure(carry) == jtu.tree_structure(out) and all(
        jnp.shape(a) == jnp.shape(b) and jnp.result_type(a) == jnp.result_type(b)
        for a, b in zip(jtu.tree_leaves(carry), jtu.tree_leaves(out))
    )
    if same:
        return

    def describe(tree: PyTree) -> str:
        shapes = jtu.tree_map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree
        )
        return str(shapes).replace("ShapeDtypeStruct", "")

    changed = jtu.tree_structure(carry) != jtu.tree_structure(out)
    raise TypeError(
        "`Stacked.__call__`: a layer must return what it takes, but it took "
        f"{describe(carry)} and returned {describe(out)}. For a layer that also "
        "returns its own output (a KV cache), use `stacked.scan`: "
        "`x, caches = stacked.scan(lambda layer, x, _: layer(x), x)`."
        + see(7 if changed else 8)
    )


def _slice_text(index: slice) -> str:
    parts = ["" if v is None else str(v) for v in (index.start, index.stop)]
    return ":".join(parts) + ("" if index.step is None else f":{index.step}")


def _check_same_layer(layer0: Any, layer: Any, i: int) -> None:
    """Raises naming the first leaf where `layer` (number `i`) differs from layer 0."""
    where = "`Stacked.from_layers`"
    for a, b in itertools.zip_longest(_paths.leaves(layer0), _paths.leaves(layer)):
        if a is None or b is None:
            extra = next(leaf for leaf in (a, b) if leaf is not None)
            raise ValueError(
                f"{where}: layer {i} differs in structure from layer 0 at leaf "
                f"{extra.path!r}, which only one of them has." + see(1)
            )
        if a.path != b.path:
            raise ValueError(
                f"{where}: layer {i} differs in structure from layer 0: leaf "
                f"{a.path!r} in layer 0 is {b.path!r} in layer {i}." + see(1)
            )
        if is_arraylike(a.value) != is_arraylike(b.value):
            raise ValueError(
                f"{where}: leaf {a.path!r} is an array in one of layers 0 and {i} but "
                "not in the other." + see(1)
            )
        if is_arraylike(a.value):
            if (a.value.shape, a.value.dtype) != (b.value.shape, b.value.dtype):
                raise ValueError(
                    f"{where}: leaf {a.path!r} is {a.value.dtype}{list(a.value.shape)} "
                    f"in layer 0 but {b.value.dtype}{list(b.value.shape)} in layer {i}."
                    + see(1)
                )
        elif not _same(a.value, b.value):
            raise ValueError(
                f"{where}: non-array leaf {a.path!r} is {a.value!r} in layer 0 but "
                f"{b.value!r} in layer {i}. Layers share their non-array fields."
                + see(1)
            )
    if jtu.tree_structure(layer) != jtu.tree_structure(layer0):
        raise ValueError(
            f"{where}: layer {i} differs from layer 0 in a static field: "
            f"{jtu.tree_structure(layer0)} vs {jtu.tree_structure(layer)}." + see(1)
        )


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # arrays, tracers: no single truth value
        return a is b


def map_arrays(fn: Callable[[Any], Any], tree: Any) -> Any:
    def apply(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.eval_shape(fn, x)
        return fn(x) if eqx.is_array(x) else x

    return jtu.tree_map(apply, tree)


def whole_to_device(x: Any) -> Any:
    """A host-resident stacked leaf the TPU compiler cannot slice, on the device.

    Such a leaf is a per-layer scalar or vector, such as a bias
    (`_tiling.slices_by_layer`). It is small, and goes to the device whole,
    before the scan.
    """
    if eqx.is_array(x) and is_host(x) and not _tiling.slices_by_layer(x.shape):
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def keep_carry_sharding(new: Any, old: Any) -> Any:
    """A layer's output carry, resharded to its input's under `Explicit` axes.

    A scan carry must keep its type. A layer whose weights are sharded (FSDP,
    tensor parallelism) changes the sharding of what it computes. Under `Auto`
    axes the partitioner reshards by itself.
    """
    if not _layout.explicit_axes():
        return new

    def reshard(n: Any, o: Any) -> Any:
        if not eqx.is_array(n) or not eqx.is_array(o):
            return n
        want = jax.typeof(o).sharding.spec
        same = jax.typeof(n).sharding.spec == want
        return n if same else jax.sharding.reshard(n, want)

    return jtu.tree_map(reshard, new, old)
