"""`Policy`: where parameters, residuals and optimizer state live."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NoReturn

import equinox as eqx
import numpy as np
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from . import _paths, _policy_args as _args
from ._errors import see
from ._layout import check_batch, check_rules, FSDP, Rules
from ._memory_kinds import check_kind, MemoryKind, ParamsSpec


def _params(value: Any, argument: str = "params") -> ParamsSpec:
    if value is None:
        return None
    if isinstance(value, str):
        check_kind(value, f"`Policy({argument}=...)`")
        return value
    if isinstance(value, Mapping):
        items = tuple(value.items())
    elif isinstance(value, tuple) and all(
        isinstance(i, tuple) and len(i) == 2 for i in value
    ):
        items = value
    else:
        raise TypeError(
            f"`Policy({argument}=...)` must be None, a memory kind, or a mapping from "
            f"patterns to kinds, got {value!r}." + see(20)
        )
    for pattern, kind in items:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"`Policy({argument}=...)` has key {pattern!r}. Keys are non-empty "
                "leaf path patterns, e.g. 'blocks'."
            )
        check_kind(kind, f"`Policy({argument}=...)[{pattern!r}]`")
        # A key `"<part>:<pattern>"` names a part of the optimizer state.
        part, colon, params = pattern.partition(":")
        if colon:
            if argument != "opt_state":
                raise ValueError(
                    f"`Policy({argument}=...)` has key {pattern!r}, a part of the "
                    "optimizer state. Move it to `opt_state=`." + see(117)
                )
            if not (part.isidentifier() and params):
                raise ValueError(
                    f"`Policy(opt_state=...)` has key {pattern!r}. Write "
                    "'<part>:<parameter pattern>', e.g. 'nu:**'." + see(117)
                )
    return items


class Policy(eqx.Module):
    """Where parameters, saved activations ("residuals") and optimizer state live.

    Checkpoint names are dotted paths from the argument that holds a `Stacked`. The
    carry entering each layer of `model.blocks` is `"blocks.input"`. The output of a
    submodule `mlp` inside a block is `"blocks.mlp"`. Names may be patterns: `*` matches
    within one dotted segment, `**` across segments.

    Every name (or pattern) in `save` and `offload` must occur while tracing. It must
    name a value saved for the backward pass (a residual). Otherwise tracing raises a
    `ValueError` listing the names that did occur.

    Presets, each taking the same fields as keyword overrides
    (`Policy.remat(opt_state="pinned_host")`):

    | preset | params | save | offload | opt_state |
    |---|---|---|---|---|
    | `none()` | `None` | `"all"` | `()` | `"device"` |
    | `remat()` | `None` | `()` | `()` | `"device"` |
    | `offload_residuals()` | `None` | `()` | `("**.input",)` | `"device"` |
    | `offload_all()` | `"pinned_host"` | `()` | `("**.input",)` | `"pinned_host"` |
    """

    params: ParamsSpec = eqx.field(static=True)
    save: Literal["all"] | tuple[str, ...] = eqx.field(static=True)
    offload: tuple[str, ...] = eqx.field(static=True)
    offload_dst: MemoryKind = eqx.field(static=True)
    opt_state: str | tuple[tuple[str, str], ...] = eqx.field(static=True)
    update: Literal["auto", "streamed", "whole", "host"] = eqx.field(static=True)
    shard: Rules | None = eqx.field(static=True)
    batch: PartitionSpec | None = eqx.field(static=True)
    compute_dtype: np.dtype | None = eqx.field(static=True)
    keep_dtype: tuple[str, ...] = eqx.field(static=True)
    host_tables: tuple[str, ...] = eqx.field(static=True)
    loss_axes: Literal["auto", "explicit"] = eqx.field(static=True)
    host_remat: bool = eqx.field(static=True)
    prefetch: int = eqx.field(static=True)
    update_timing: Literal["now", "next_forward"] = eqx.field(static=True)

    def __init__(
        self,
        *,
        params: None | MemoryKind | Mapping[str, MemoryKind] = None,
        save: Literal["all"] | Sequence[str] = (),
        offload: Sequence[str] = (),
        offload_dst: MemoryKind = "pinned_host",
        opt_state: MemoryKind | Mapping[str, MemoryKind] = "device",
        update: Literal["auto", "streamed", "whole", "host"] = "auto",
        shard: PartitionSpec
        | FSDP
        | str
        | Mapping[str, PartitionSpec | FSDP | str]
        | None = None,
        batch: None | PartitionSpec | str = None,
        compute_dtype: DTypeLike | None = None,
        keep_dtype: Sequence[str] = (),
        host_tables: Sequence[str] = (),
        loss_axes: Literal["auto", "explicit"] = "auto",
        host_remat: bool = False,
        prefetch: int = 0,
        update_timing: Literal["now", "next_forward"] = "now",
        **renamed: Any,
    ):
        """**Arguments:**

        - `params`: where parameter leaves live between steps. `None`: no opinion (field
            annotations and current placement decide). A memory kind: every array leaf.
            A mapping from leaf-path pattern to kind: the longest matching pattern wins.
            A pattern matches a leaf path or a dotted prefix of it (`"blocks"` covers
            every leaf under `blocks`). A pattern that matches no leaf is a `ValueError`
            when the policy is applied.
        - `save`: checkpoint names kept on the device in the forward pass. `"all"`: no
            `jax.checkpoint` at all, so nothing is recomputed.
        - `offload`: checkpoint names moved to `offload_dst` in the forward pass. They
            come back for the backward pass. Names in neither `save` nor `offload` are
            recomputed.
        - `offload_dst`: where offloaded residuals go. Only `"pinned_host"` works in JAX
            0.10.
        - `opt_state`: where the parameter-shaped optimizer state lives between steps.
            Step counters and other scalars stay on the device. One memory kind, or a
            mapping from parameter-path pattern to kind, matched as in `params`. The
            state of a parameter no pattern matches stays on the device. `{"**":
            "pinned_host", "blocks.norm.weight": "device"}` keeps one parameter's state
            on the device and the rest on the host. A key `"<part>:<pattern>"` also
            names the part of the state. That part is the field of the optimizer's state
            holding that copy of the parameters. `{"nu:**": "pinned_host"}` moves Adam's
            second moment to the host. Its first moment stays on the device. The pattern
            naming the parameter most precisely wins. Of two equally precise ones, the
            one naming a part wins.
        - `update`: how `train_step` applies the optimizer when parameters, gradients or
            state are on the host.
            `"auto"` (the default): `"streamed"` where host memory is its own (TPU,
            GPU), `"whole"` on the CPU. The CPU's memory kinds share one memory, so
            streaming saves nothing there. The choice is made inside the traced program
            (`jax.lax.platform_dependent`). So a report compiled for a TPU shows the
            streamed update.
            `"streamed"`: one layer of each `Stacked` is on the device at a time. A
            large leaf moves one block of rows at a time. The result is that of optax's
            whole-tree update. An update that cannot be split that way is an error
            naming the operation.
            `"whole"`: everything is brought to the device at once (more device memory).
            `"host"` (**experimental**, `ExperimentalWarning`): the host's CPU updates
            the host-resident parameters and state inside the step (JAX's host
            compute). The device sends each gradient once and receives only the
            parameters it computes with. Measured on an H200 it is 2.75x slower than
            `"streamed"`, with 1.8x the host memory (docs/benchmarks/host-update.md).
            It needs optimizer state on the host. An optimizer the host cannot run
            (a loop, a callback) is an error naming the optax code.
        - `shard`: how parameter leaves are laid out over the device mesh. It names mesh
            axes only. The mesh comes from `jax.set_mesh`, the arrays, or `place(...,
            mesh=...)`. `None`: no opinion, so leaves keep their sharding. A mapping:
            from leaf-path pattern (matched as in `params`) to a layout. A layout is a
            `PartitionSpec`, an `eqx_offload.FSDP`, or a mesh axis name (short for
            `FSDP(name)`). One such value applies to every leaf: `shard="fsdp"` shards
            every large leaf along the axis `"fsdp"`. The spec of a leaf inside a
            `Stacked` describes one layer. The layer axis is never split. Leaves no
            pattern matches keep their sharding.
        - `batch`: the `PartitionSpec` of the batch arguments' leading dimensions
            (`PartitionSpec("data")`, or just `"data"`). `train_step` lays out batch
            arrays not yet on the mesh this way. Scalars are replicated.
        - `compute_dtype`: the dtype the loss computes with (`jnp.bfloat16`), or `None`
            for the parameters' own. The parameters stay in their dtype (the fp32
            master) where `params` puts them. The optimizer updates them with fp32
            gradients. Each host-resident parameter gets a persistent copy in
            `compute_dtype`. So only half the bytes move to the device. The copy lives
            in the optimizer state, where `opt_state` puts that parameter's state. Every
            update rewrites it. Parameters on the device are cast where the loss uses
            them.
        - `keep_dtype`: leaf-path patterns of parameters the loss uses in their own
            dtype under `compute_dtype`. They match as in `params`. E.g. `("**.norm*",)`
            keeps every LayerNorm's weight and bias in fp32. A pattern that matches no
            trainable leaf is a `ValueError` when the policy is applied.
        - `host_tables`: leaf-path patterns of large `[vocab, dim]` tables that stay in
            host memory inside the step. Such a table is an embedding or an output
            projection. Otherwise it moves to the device whole where the step starts.
            `eo.embed` and `eo.chunked_cross_entropy` read such a table one block of
            rows at a time. They write its gradient back the same way. The leaf must be
            host-resident (`params`) and outside any `Stacked`. Only those two functions
            may use it: anything else is an error naming the leaf. A pattern that
            matches no host-resident leaf is a `ValueError`. E.g.
            `Policy.offload_all(host_tables=("embed",))`. Over a mesh a host table stays
            whole on every device. `FSDP` rules leave it replicated; a spec that splits
            it is an error. (The TPU compiler cannot read row blocks of a host table
            split over chips.)
        - `loss_axes`: the mesh axis types the loss is traced under. It matters when the
            model's mesh has `Explicit` axes. (The loss is the function `filter_offload`
            wraps.)
            `"auto"` (the default): the loss runs on `Auto` axes
            (`jax.sharding.auto_axes`), as plain JAX code is written. An unmodified
            model runs. For example, an `eqx.nn.Embedding` lookup of token ids split
            over the batch. Or a cache written with `.at[i].set`. The partitioner lays
            out what it computes. The gradients come back laid out like the parameters.
            The loss and `aux` come back replicated over the mesh. Arrays enter the loss
            through its arguments. Under `Explicit` axes, JAX refuses an array the loss
            closes over.
            `"explicit"`: the mesh's `Explicit` axes are kept inside the loss. This
            suits a model written for explicit sharding (`out_sharding=`,
            `jax.sharding.reshard`). The step then gathers each `FSDP`-sharded weight
            before use, one layer at a time. Each layer's output carry gets the sharding
            of its input.
            On a mesh with `Auto` axes (or none) both are the same.
        - `host_remat`: on a TPU, let the compiler keep some values in host memory.
            These are values it would otherwise recompute to fit the chip's memory. This
            is the compiler's own rematerialization, not `save`/`offload`'s. It covers
            the parts of the step outside `Stacked` scans. It changes where values wait,
            not what is computed. It is a TPU compiler option. `train_step` and
            `memory_report(target="tpu-...")` pass it. On another backend the step
            raises a `ValueError`. A step of your own (`eo.filter_offload`) does not
            pass it: give the option to its `jax.jit`. Try it on small programs first.
            It can abort the compiling process (design notes, "What the TPU compiler
            cannot stream").
        - `prefetch` (**experimental**, `ExperimentalWarning`): how many layers
            ahead a `Stacked`'s scan reads its layers. `0` (the default): each layer
            is read where the scan reaches it, as `jax.lax.scan` does. `1`: while
            layer `i` computes, the forward pass reads layer `i + 1`'s parameters (the
            backward pass layer `i - 1`'s, and its offloaded residuals). It costs one
            more layer on the device. Measured on an H200 it gained nothing (173.6 ms
            against 173.3 ms; docs/benchmarks/prefetch.md). It applies to a
            `Stacked` whose parameters live on the host or whose residuals are
            offloaded. Under `Explicit` mesh axes and under `jax.jvp` the scan is
            plain. `jax.linearize` of a prefetching step cannot be evaluated.
        - `update_timing`: when `train_step` applies the optimizer update of the
            stacked layers' weights (their leaves with two or more axes per layer).
            `"now"` (the default): at the end of the step that computed the
            gradients. `"next_forward"` (**experimental**, `ExperimentalWarning`): in
            the next step, inside the forward scan, each layer just before it
            computes, so the update can overlap the compute. The numbers are those of
            `"now"`. Measured on an H200 it is 0.9% (0.2B) to 3.3% (0.9B) faster
            (docs/benchmarks/update-timing.md). Between steps the update is
            *pending*: the returned model's `Stacked`s are marked, and refuse to run
            (and `save`, `state_dict` refuse them) until
            `eqx_offload.apply_pending`. With micro-batches, `compute_dtype` or
            `Explicit` axes, the step applies the update before the loss, hiding
            nothing (a warning says so). It needs the streamed update. (`"delayed"`
            was removed.)
        """
        for name in renamed:
            unknown = f"`Policy` got an unexpected keyword argument {name!r}."
            raise TypeError(_args.RENAMED.get(name, unknown))
        self.params = _params(params)
        self.save = "all" if save == "all" else _args.name_patterns(save, "save")
        self.offload = _args.name_patterns(offload, "offload")
        self.offload_dst = offload_dst
        opt = _params(opt_state, "opt_state")
        if opt is None:
            raise TypeError(
                "`Policy(opt_state=None)`: give a memory kind (e.g. 'device') or a "
                "mapping from patterns to kinds."
            )
        self.opt_state = opt
        self.update = update
        self.shard = check_rules(shard)
        self.batch = check_batch(batch)
        self.compute_dtype = _args.check_compute_dtype(compute_dtype)
        self.keep_dtype = _args.name_patterns(keep_dtype, "keep_dtype")
        self.host_tables = _args.name_patterns(host_tables, "host_tables")
        self.loss_axes = loss_axes
        if not isinstance(host_remat, bool):
            raise TypeError(f"`Policy(host_remat={host_remat!r})`: give True or False.")
        self.host_remat = host_remat
        self.prefetch = prefetch
        self.update_timing = update_timing
        if self.keep_dtype and self.compute_dtype is None:
            raise ValueError(
                f"`Policy(keep_dtype={self.keep_dtype!r})` has no effect without "
                "`compute_dtype`. Give `compute_dtype` too." + see(90)
            )

    def __check_init__(self):
        check_kind(self.offload_dst, "`Policy(offload_dst=...)`")
        if self.offload_dst != "pinned_host":
            raise ValueError(
                f"`Policy(offload_dst={self.offload_dst!r})`: residuals can only be "
                "offloaded to 'pinned_host'. Use `save=` to keep them." + see(22)
            )
        _args.check_choice("update", self.update)
        state = self.opt_state
        kinds = {state} if isinstance(state, str) else {k for _, k in state}
        if self.update == "host" and kinds <= {"device"}:
            raise ValueError(
                "`Policy(update='host')` needs optimizer state on the host, but "
                "`opt_state` keeps it on the device. Give `opt_state='pinned_host'`."
                + see(128)
            )
        if isinstance(self.prefetch, bool) or self.prefetch not in (0, 1):
            raise ValueError(
                f"`Policy(prefetch={self.prefetch!r})`: valid values are 0 and 1 "
                "(read one layer ahead)." + see(131)
            )
        if self.update_timing == "delayed":
            raise ValueError(
                "`Policy(update_timing='delayed')` was removed: its one-step-stale "
                "gradients bought no speed (estimated slower than `'now'`). Use "
                "`update_timing='now'` (the default), or the experimental "
                "`'next_forward'`." + see(147)
            )
        _args.check_choice("update_timing", self.update_timing)
        if self.update_timing != "now" and self.update not in ("auto", "streamed"):
            raise ValueError(
                f"`Policy(update_timing={self.update_timing!r})` updates a layer at "
                f"a time, which `update={self.update!r}` cannot. Use "
                "`update='streamed'`." + see(136)
            )
        _args.check_choice("loss_axes", self.loss_axes)
        _args.check_save_and_offload(self.save, self.offload)
        for (field, value), message in _args.EXPERIMENTAL.items():
            if getattr(self, field) == value:
                _args.warn_once(message)

    @property
    def stream(self) -> NoReturn:
        raise AttributeError(_args.RENAMED["stream"])

    @classmethod
    def none(cls, **overrides: Any) -> "Policy":
        """No offloading and no rematerialisation.

        Every residual stays on the device. Parameters and optimizer state stay where
        they are.
        """
        return cls(**{"save": "all", **overrides})

    @classmethod
    def remat(cls, **overrides: Any) -> "Policy":
        """Full rematerialisation of each stacked layer.

        Only the carry between layers is kept (on the device). Everything inside a layer
        is recomputed.
        """
        return cls(**overrides)

    @classmethod
    def offload_residuals(cls, **overrides: Any) -> "Policy":
        """The carry entering each stacked layer is offloaded to pinned host memory.

        It leaves in the forward pass and comes back for the backward pass. The rest of
        the layer is recomputed. Device memory for activations no longer grows with
        depth.
        """
        _args.check_replaced("offload_residuals", overrides)
        return cls(**{"offload": _args.LAYER_INPUTS, **overrides})

    @classmethod
    def offload_all(cls, **overrides: Any) -> "Policy":
        """`offload_residuals`, with parameters and optimizer state on the host.

        Every parameter and the parameter-shaped optimizer state are kept in pinned host
        memory between steps. Each stacked layer's parameters are brought to the device
        inside the scan, one layer at a time.
        """
        _args.check_replaced("offload_all", overrides)
        on_host = {"params": "pinned_host", "opt_state": "pinned_host"}
        return cls(**{"offload": _args.LAYER_INPUTS, **on_host, **overrides})


def replace(policy: Policy, **changes: Any) -> Policy:
    """`policy` with some fields changed, as `dataclasses.replace` would give it.

    Its patterns are given back to `Policy(...)` as the mappings it takes (its
    annotations, checked by beartype in the tests, take no pairs).
    """
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    for name in ("params", "opt_state", "shard"):
        if isinstance(fields[name], tuple):
            fields[name] = dict(fields[name])
    return Policy(**(fields | changes))


def checkpoint_patterns(policy: Policy) -> tuple[str, ...]:
    """Every pattern in `policy.save` and `policy.offload`."""
    return (() if policy.save == "all" else policy.save) + policy.offload


def split_names(policy: Policy, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """The occurring `names` to save and to offload. A name matched by a `save`
    pattern and an `offload` pattern is a `ValueError`."""
    save = () if policy.save == "all" else policy.save
    to_save, to_offload = [], []
    for name in names:
        s = [p for p in save if _paths.matches(p, name)]
        o = [p for p in policy.offload if _paths.matches(p, name)]
        if s and o:
            raise ValueError(
                f"`Policy`: checkpoint name {name!r} matches `save` pattern "
                f"{s[0]!r} and `offload` pattern {o[0]!r}. Make them disjoint."
                + see(24)
            )
        if s:
            to_save.append(name)
        elif o:
            to_offload.append(name)
    return to_save, to_offload


PRESETS = ("none", "remat", "offload_residuals", "offload_all")


def check_policy(policy: Any, where: str) -> None:
    """Raises a `TypeError` naming the argument and the fix unless `policy` is a
    `Policy`."""
    if isinstance(policy, Policy):
        return
    hint, number = "", 13
    if isinstance(policy, str) and policy in PRESETS:
        hint = f" For the preset, write `eqx_offload.Policy.{policy}()`."
    elif getattr(policy, "__self__", None) is Policy:
        name = getattr(policy, "__name__", "")
        hint, number = f" Call the preset: `eqx_offload.Policy.{name}()`.", 14
    elif isinstance(policy, str):
        presets = _paths.quoted(f"Policy.{p}()" for p in PRESETS)
        hint = f" The presets are {presets}."
    raise TypeError(
        f"{where} must be an `eqx_offload.Policy`, got {type(policy).__name__} "
        f"{policy!r}.{hint}" + see(number)
    )
