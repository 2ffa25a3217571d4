"""`Policy`: where parameters, residuals and optimizer state live."""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from . import _paths
from ._layout import check_batch, check_rules, FSDP, Rules
from ._memory_kinds import check_kind, MemoryKind, ParamsSpec
from ._warn import warn_at_caller


def _name_patterns(value: Any, argument: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        paths = argument in ("keep_dtype", "stream")
        what = "leaf-path patterns" if paths else "checkpoint names"
        raise TypeError(
            f"`Policy({argument}=...)` must be a sequence of {what} or patterns "
            f"(strings), got {value!r}."
        )
    for name in value:
        if not name or name != name.strip():
            raise ValueError(
                f"`Policy({argument}=...)` contains {name!r}; names must be non-empty "
                "and have no surrounding spaces."
            )
    return tuple(value)


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
            f"leaf path patterns to memory kinds, got {value!r}."
        )
    for pattern, kind in items:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"`Policy({argument}=...)` has key {pattern!r}; keys are non-empty "
                "leaf path patterns such as 'blocks' or 'blocks.mlp.*'."
            )
        check_kind(kind, f"`Policy({argument}=...)[{pattern!r}]`")
        if ":" in pattern:
            part, _, params = pattern.partition(":")
            if argument != "opt_state":
                raise ValueError(
                    f"`Policy({argument}=...)` has key {pattern!r}: a "
                    "'part:pattern' key names a part of the optimizer state "
                    "(`{'nu:**': 'pinned_host'}`) and belongs in "
                    "`Policy(opt_state=...)`."
                )
            if not part.isidentifier() or not params:
                raise ValueError(
                    f"`Policy(opt_state=...)` has key {pattern!r}; a key naming a "
                    "part of the state is '<part>:<parameter pattern>', such as "
                    "'nu:**' or 'mu:blocks'."
                )
    return items


def _compute_dtype(value: Any) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`Policy(compute_dtype={value!r})` must be a floating-point dtype such "
            "as `jnp.bfloat16`, or None."
        )
    return dtype


class Policy(eqx.Module):
    """Where parameters, saved activations ("residuals") and optimizer state live.

    Checkpoint names are dotted paths from the argument that holds a `Stacked`: the
    carry entering each layer of `model.blocks` is `"blocks.input"`, the output of a
    submodule `mlp` inside a block is `"blocks.mlp"`. Names may be patterns: `*`
    matches within one dotted segment, `**` across segments.

    Every name (or pattern) in `save` and `offload` must occur while tracing, and
    must name a value that is saved for the backward pass (a residual); otherwise
    tracing raises a `ValueError` listing the names that did occur.

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
    stream: tuple[str, ...] = eqx.field(static=True)
    loss_axes: Literal["auto", "explicit"] = eqx.field(static=True)
    host_remat: bool = eqx.field(static=True)
    prefetch: int = eqx.field(static=True)
    update_timing: Literal["now", "next_forward", "delayed"] = eqx.field(static=True)

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
        stream: Sequence[str] = (),
        loss_axes: Literal["auto", "explicit"] = "auto",
        host_remat: bool = False,
        prefetch: int = 0,
        update_timing: Literal["now", "next_forward", "delayed"] = "now",
    ):
        """**Arguments:**

        - `params`: where parameter leaves live between steps. `None`: no opinion
            (field annotations and current placement decide); one memory kind for
            every array leaf; or a mapping from leaf-path pattern to kind, where a
            pattern matches a leaf path or a dotted prefix of it (`"blocks"` covers
            every leaf under `blocks`) and the longest match wins. A pattern that
            matches no leaf is a `ValueError` when the policy is applied.
        - `save`: checkpoint names kept on the device in the forward pass, or
            `"all"`: no `jax.checkpoint` at all, nothing is recomputed.
        - `offload`: checkpoint names moved to `offload_dst` in the forward pass and
            brought back for the backward pass. Names in neither `save` nor `offload`
            are recomputed.
        - `offload_dst`: where offloaded residuals go; only `"pinned_host"` works
            in JAX 0.10.
        - `opt_state`: where the parameter-shaped optimizer state lives between
            steps (step counters and other scalars stay on the device): one memory
            kind, or a mapping from parameter-path pattern to kind, matched as in
            `params` (the state of a parameter no pattern matches stays on the
            device). `{"**": "pinned_host", "blocks.norm.weight": "device"}` keeps
            one parameter's state on the device and the rest on the host. A key
            `"<part>:<pattern>"` also names the part of the state, the field of
            the optimizer's state holding that copy of the parameters:
            `{"nu:**": "pinned_host"}` moves Adam's second moment to the host and
            keeps its first on the device. The pattern naming the parameter most
            precisely wins; of two equally precise ones, the one naming a part.
        - `update`: how `train_step` applies the optimizer when parameters,
            gradients or state are on the host. `"auto"` (the default):
            `"streamed"` where host memory is its own (TPU, GPU), `"whole"` on the
            CPU, whose memory kinds share one memory, so streaming saves nothing
            there and costs time; chosen inside the one traced program
            (`jax.lax.platform_dependent`), so a report compiled for a TPU shows
            the streamed update. `"streamed"`: one layer of each
            `Stacked` (or one block of rows of a large leaf) on the device at a
            time, with the same result as optax's whole-tree update; an update that
            cannot be split that way is an error naming the operation. `"whole"`:
            everything is brought to the device at once (more device memory).
            `"host"`: the update of the host-resident parameters and state runs on
            the host's CPU inside the step (JAX's host compute), so the device
            sends each gradient once and receives only the parameters it computes
            with: no optimizer state crosses the host link. Parameters whose state
            stays on the device are updated there, unless the update ties them to
            host-resident values (a global-norm clip), when they are updated on
            the host too. Needs optimizer state on the host; an optimizer the host
            cannot run (a loop, a callback) is an error naming the optax code.
            `eo.plan` picks it where the estimate says it is faster.
        - `shard`: how parameter leaves are laid out over the device mesh, naming
            mesh axes only (the mesh comes from `jax.set_mesh`, the arrays, or
            `place(..., mesh=...)`). `None`: no opinion (leaves keep the sharding
            they have). A mapping from leaf-path pattern (matched as in `params`)
            to a `PartitionSpec`, an `eqx_offload.FSDP`, or a mesh axis name
            (short for `FSDP(name)`); one such value applies to every leaf:
            `shard="fsdp"` shards every large leaf along the axis `"fsdp"`. The
            spec of a leaf inside a `Stacked` describes one layer: the layer axis
            is never split. Leaves no pattern matches keep their sharding.
        - `batch`: the `PartitionSpec` of the batch arguments' leading dimensions
            (`PartitionSpec("data")`, or just `"data"`): `train_step` lays out
            batch arrays not yet on the mesh this way (scalars are replicated).
        - `compute_dtype`: the dtype the loss computes with (`jnp.bfloat16`), or
            `None`: the parameters' own. The parameters stay in their dtype (the
            fp32 master) where `params` puts them, and the optimizer updates them
            with fp32 gradients. Each host-resident parameter gets a persistent
            copy in `compute_dtype`, kept in the optimizer state (where
            `opt_state` puts that parameter's state) and rewritten by every
            update, so that half the bytes move to the device; parameters on the
            device are cast where the loss uses them.
        - `keep_dtype`: leaf-path patterns of parameters the loss uses in their
            own dtype under `compute_dtype`, matched as in `params` (e.g.
            `("**.norm*",)` keeps every LayerNorm's weight and bias fp32). A
            pattern that matches no trainable leaf is a `ValueError` when the
            policy is applied.
        - `stream`: leaf-path patterns of large `[vocab, dim]` tables (an
            embedding, an output projection) that stay in host memory inside the
            step, rather than moving to the device whole where it starts:
            `eo.embed` and `eo.chunked_cross_entropy` read them one block of rows
            at a time and write their gradients back the same way. Such a leaf
            must be host-resident (`params`), outside any `Stacked`, and used
            only by those two functions (anything else is an error naming the
            leaf); a pattern that matches no host-resident leaf is a
            `ValueError`. E.g. `Policy.offload_all(stream=("embed",))`. Over
            a mesh a streamed table stays whole on every device: `FSDP` rules
            leave it replicated, and a spec that splits it is an error (the TPU
            compiler cannot read row blocks of a host table split over chips).
        - `loss_axes`: the mesh axis types the loss (the function `filter_offload`
            wraps) is traced under when the model's mesh has `Explicit` axes.
            `"auto"` (the default): on `Auto` axes (`jax.sharding.auto_axes`), as
            plain JAX code is written: an unmodified model runs (an
            `eqx.nn.Embedding` lookup of token ids split over the batch, a cache
            written with `.at[i].set`), the partitioner lays out what it
            computes, the gradients come back laid out like the parameters, and
            the loss and `aux` come back replicated over the mesh. Arrays enter
            the loss through its arguments: one it closes over, traced under
            `Explicit` axes, is refused by JAX. `"explicit"`:
            the mesh's `Explicit` axes are kept inside the loss, for a model
            written for explicit sharding (`out_sharding=`,
            `jax.sharding.reshard`); the step then gathers each `FSDP`-sharded
            weight before use, one layer at a time, and gives each layer's
            output carry the sharding of its input. On a mesh with `Auto` axes
            (or none) both are the same.
        - `host_remat`: on a TPU, let the compiler keep in host memory the values
            it would otherwise recompute to fit the chip's memory (its own
            rematerialization, not `save`/`offload`'s: the parts of the step
            outside `Stacked` scans; the TPU compiler's remat-to-host option).
            It changes where
            values wait, not what is computed. A compile option of the TPU
            compiler: `train_step` and `memory_report(target="tpu-...")` pass it,
            and on another backend the step raises a `ValueError`; a step of your
            own (`eo.filter_offload`) does not: pass the option to its `jax.jit`.
            libtpu 0.0.42 aborted the process compiling a 66-layer GPT step with
            it (a failed check in its rematerialization pass): `plan` compiles
            it in a child process; try it on small programs first.
        - `prefetch`: how many layers ahead a `Stacked`'s scan reads its layers.
            `0` (the default): each layer is read where the scan reaches it, as
            a plain `jax.lax.scan` does. `1`: while layer `i` computes, the
            forward pass reads layer `i + 1`'s parameters and the backward pass
            layer `i - 1`'s parameters and offloaded residuals, so the compiler
            can hide the host link behind compute, for one more layer on the
            device and one more layer read per step. It applies to a `Stacked`
            whose parameters live on the host or whose residuals are offloaded
            (elsewhere the scan is plain), and not yet under a mesh with
            `Explicit` axes. Under forward-mode differentiation (`jax.jvp`)
            the scan is plain whatever the value (a prefetching scan is a
            `jax.custom_vjp`); `jax.linearize` of a prefetching step cannot be
            evaluated: use `prefetch=0` there.
        - `update_timing`: when `train_step` applies the optimizer update of the
            stacked layers' parameters and state. `"now"` (the default): at the
            end of the step that computed the gradients. `"next_forward"`: in
            the next step, layer by layer inside the forward scan, just before
            each layer computes, so that the update's reads and writes can
            overlap the layers' compute; the numbers are those of `"now"`.
            Between steps the model and state hold that update *pending*:
            apply it with `eqx_offload.apply_pending` before reading the
            model (`save` and `verify` refuse a pending update and say so).
            `"delayed"`: DeepSpeed's delayed parameter update: each step's
            layers compute with their weights before the previous step's
            update, which is applied alongside; their gradients are one step
            stale (docs: "The update hidden too"). Both apply to the stacked
            leaves updated a layer at a time (two or more axes per layer:
            the weights); the rest of the model (per-layer vectors such as
            biases and norms too) is updated at the end of every step. Both
            need the streamed update (`update="auto"` or `"streamed"`).
        """
        self.params = _params(params)
        self.save = "all" if save == "all" else _name_patterns(save, "save")
        self.offload = _name_patterns(offload, "offload")
        self.offload_dst = offload_dst
        opt = _params(opt_state, "opt_state")
        if opt is None:
            raise TypeError(
                "`Policy(opt_state=None)`: give a memory kind (e.g. 'device') or a "
                "mapping from parameter-path pattern to memory kind."
            )
        self.opt_state = opt
        self.update = update
        self.shard = check_rules(shard)
        self.batch = check_batch(batch)
        self.compute_dtype = _compute_dtype(compute_dtype)
        self.keep_dtype = _name_patterns(keep_dtype, "keep_dtype")
        self.stream = _name_patterns(stream, "stream")
        self.loss_axes = loss_axes
        if not isinstance(host_remat, bool):
            raise TypeError(f"`Policy(host_remat={host_remat!r})`: give True or False.")
        self.host_remat = host_remat
        self.prefetch = prefetch
        self.update_timing = update_timing
        if self.keep_dtype and self.compute_dtype is None:
            raise ValueError(
                f"`Policy(keep_dtype={self.keep_dtype!r})` has no effect without "
                "`compute_dtype`; give `compute_dtype=jnp.bfloat16` too, or drop "
                "`keep_dtype`."
            )

    def __check_init__(self):
        check_kind(self.offload_dst, "`Policy(offload_dst=...)`")
        if self.offload_dst != "pinned_host":
            raise ValueError(
                f"`Policy(offload_dst={self.offload_dst!r})`: residuals can only be "
                "offloaded to 'pinned_host' (JAX 0.10 leaves them on the device for "
                "'unpinned_host'); to keep them on the device, list them in `save=`."
            )
        if self.update not in ("auto", "streamed", "whole", "host"):
            raise ValueError(
                f"`Policy(update={self.update!r})`: valid values are 'auto', "
                "'streamed', 'whole' and 'host'."
            )
        state_kinds = (
            {self.opt_state}
            if isinstance(self.opt_state, str)
            else {k for _, k in self.opt_state}
        )
        if self.update == "host" and state_kinds <= {"device"}:
            raise ValueError(
                "`Policy(update='host')` runs the optimizer on the host's CPU where "
                "its state lives, but `opt_state` keeps it on the device; put it on "
                "the host with `opt_state='pinned_host'` (as "
                "`Policy.offload_all()` does), or drop `update='host'`."
            )
        if isinstance(self.prefetch, bool) or self.prefetch not in (0, 1):
            raise ValueError(
                f"`Policy(prefetch={self.prefetch!r})`: valid values are 0 (read "
                "each layer where the scan reaches it) and 1 (read one layer ahead)."
            )
        if self.update_timing not in ("now", "next_forward", "delayed"):
            raise ValueError(
                f"`Policy(update_timing={self.update_timing!r})`: valid values are "
                "'now', 'next_forward' and 'delayed'."
            )
        if self.update_timing != "now" and self.update not in ("auto", "streamed"):
            raise ValueError(
                f"`Policy(update_timing={self.update_timing!r})` applies the stacked "
                "layers' update a layer at a time, as the streamed update does; "
                f"`update={self.update!r}` cannot. Use `update='streamed'` (or "
                "'auto'), or `update_timing='now'`."
            )
        if self.loss_axes not in ("auto", "explicit"):
            raise ValueError(
                f"`Policy(loss_axes={self.loss_axes!r})`: valid values are 'auto' "
                "and 'explicit'."
            )
        if self.save == "all" and self.offload:
            raise ValueError(
                "`Policy(save='all')` keeps every residual on the device, so "
                f"`offload={self.offload!r}` could never apply; list the names to keep "
                "in `save=` instead, or drop `offload`."
            )
        if self.save != "all":
            both = [n for n in self.save if _paths.is_literal(n) and n in self.offload]
            if both:
                raise ValueError(
                    f"`Policy`: {_paths.quoted(both)} is in both `save` and `offload`; "
                    "a residual is either kept on the device or offloaded, not both."
                )

    @classmethod
    def none(cls, **overrides: Any) -> "Policy":
        """No offloading and no rematerialisation: every residual stays on the
        device, parameters and optimizer state where they are."""
        return cls(**{"save": "all", **overrides})

    @classmethod
    def remat(cls, **overrides: Any) -> "Policy":
        """Full rematerialisation of each stacked layer: only the carry between
        layers is kept (on the device); everything inside a layer is recomputed."""
        return cls(**overrides)

    @classmethod
    def offload_residuals(cls, **overrides: Any) -> "Policy":
        """The carry entering each stacked layer is offloaded to pinned host memory
        in the forward pass and brought back for the backward pass; the rest of the
        layer is recomputed. Device memory for activations no longer grows with
        depth."""
        _check_replaced("offload_residuals", overrides)
        return cls(**{"offload": _LAYER_INPUTS, **overrides})

    @classmethod
    def offload_all(cls, **overrides: Any) -> "Policy":
        """`offload_residuals` plus every parameter and the parameter-shaped
        optimizer state kept in pinned host memory between steps; each stacked
        layer's parameters are brought to the device inside the scan, one layer at
        a time."""
        _check_replaced("offload_all", overrides)
        return cls(
            **{
                "params": "pinned_host",
                "offload": _LAYER_INPUTS,
                "opt_state": "pinned_host",
                **overrides,
            }
        )


def replace(policy: Policy, **changes: Any) -> Policy:
    """`policy` with some fields changed, as `dataclasses.replace` would give it,
    but with its patterns given back to `Policy(...)` as the mappings it takes."""
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    for name in ("params", "opt_state", "shard"):
        if isinstance(fields[name], tuple):
            fields[name] = dict(fields[name])
    return Policy(**(fields | changes))


def checkpoint_patterns(policy: Policy) -> tuple[str, ...]:
    """Every pattern in `policy.save` and `policy.offload`."""
    save = () if policy.save == "all" else policy.save
    return save + policy.offload


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
                f"{s[0]!r} and `offload` pattern {o[0]!r}; make the patterns "
                "disjoint."
            )
        if s:
            to_save.append(name)
        elif o:
            to_offload.append(name)
    return to_save, to_offload


_LAYER_INPUTS = ("**.input",)


def _check_replaced(preset: str, overrides: dict[str, Any]) -> None:
    """Warns when `offload=` replaces a preset's `("**.input",)` without keeping
    it: the preset then no longer offloads the carry entering each layer, which
    is easy to miss."""
    given = overrides.get("offload", _LAYER_INPUTS)
    given = (given,) if isinstance(given, str) else given
    if isinstance(given, Sequence) and _LAYER_INPUTS[0] not in given:
        names = tuple(given)
        written = {
            "offload_all": "Policy(params='pinned_host', opt_state='pinned_host', "
            f"offload={names!r})",
            "offload_residuals": f"Policy(offload={names!r})",
        }[preset]
        warn_at_caller(
            f"`Policy.{preset}(offload={names!r})` replaces the preset's "
            f"`offload={_LAYER_INPUTS!r}`: the carry entering each layer "
            "('<path>.input') is no longer offloaded but kept on the device. To "
            f"offload both, write `offload=({_LAYER_INPUTS[0]!r}, ...)`; to "
            f"offload only these names, write the policy out: `{written}`."
        )


PRESETS = ("none", "remat", "offload_residuals", "offload_all")


def check_policy(policy: Any, where: str) -> None:
    """Raises a `TypeError` naming the argument and the fix unless `policy` is a
    `Policy`."""
    if isinstance(policy, Policy):
        return
    hint = ""
    if isinstance(policy, str) and policy in PRESETS:
        hint = f"; for the preset, write `eqx_offload.Policy.{policy}()`"
    elif getattr(policy, "__self__", None) is Policy:
        name = getattr(policy, "__name__", "")
        hint = f"; call the preset: `eqx_offload.Policy.{name}()`"
    elif isinstance(policy, str):
        hint = f"; the presets are {_paths.quoted(f'Policy.{p}()' for p in PRESETS)}"
    raise TypeError(
        f"{where} must be an `eqx_offload.Policy`, got {type(policy).__name__} "
        f"{policy!r}{hint}."
    )
