"""What `memory_report` compiles, short of tracing it: the job (`CompileJob`, which
`_memory_report.py` makes of a `train_step`, a `filter_offload` function or any
function), its arguments made abstract on the target, what each input and output
of its program is, the bytes of its arguments by memory kind, and on a backend with
one memory the split of the compiler's figures by the memory kinds.
"""

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .. import _compat, _compiler_stablehlo, _paths
from .._diagnose import DoesNotCompile
from .._memory_kinds import is_arraylike, kind_of
from .._train_step import TrainStep
from .._transform import Offloaded
from ._memory_table import PARTS
from ._targets import abstract, Where


def nbytes(x: Any, per_chip: bool = False) -> int:
    shape = x.shape
    sharding = getattr(x, "sharding", None)
    if per_chip and isinstance(sharding, NamedSharding):
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * x.dtype.itemsize


def bytes_by_kind(tree: PyTree, per_chip: bool = False) -> dict[str, int]:
    """Bytes of the array leaves of `tree`, by memory kind.

    Whole arrays, or with `per_chip` the shard one chip holds (unpadded).
    """
    out: dict[str, int] = defaultdict(int)
    for x in jtu.tree_leaves(tree):
        if is_arraylike(x):
            out[kind_of(x)] += nbytes(x, per_chip)
    return dict(out)


class CompileJob(NamedTuple):
    """What to compile (`trace()`), and how to describe it."""

    trace: Callable[[], Any]  # -> a `jax.stages.Traced`
    compiled: str  # "train_step", "filter_offload" or "function"
    arguments: dict[str, Any]
    params: Any = None
    opt_state: Any = None
    residuals: Callable[[], Any] | None = None  # -> a `Saved`
    # (what, compiler message, mesh) -> the error naming the leaves at fault
    rejected: Callable[[str, str, Any], DoesNotCompile] | None = None


def inputs(job: CompileJob) -> list[tuple[str, str]]:
    """What each input of the traced program is, for `_traffic.count`.

    The inputs are the array leaves of the arguments, in order. For a `train_step`,
    each is a parameter, optimizer state or batch leaf. For another function, the
    leaves of its first argument are parameters.
    """
    kinds = {"model": "params", "opt_state": "opt_state", "batch": "batch"}
    out = []
    for i, (name, tree) in enumerate(job.arguments.items()):
        what = kinds.get(name, "params" if i == 0 else "batch")
        prefix = "" if name in kinds else f"{name}."
        leaves = _paths.leaves(tree)
        out += [(what, prefix + x.path) for x in leaves if is_arraylike(x.value)]
    return out


def outputs(job: CompileJob) -> list[tuple[str, str]]:
    """What the first outputs of the compiled program are.

    A `train_step` returns the new parameters and optimizer state first, leaf for leaf.
    """
    if job.compiled != "train_step":
        return []
    return [i for i in inputs(job) if i[0] in ("params", "opt_state")]


def policy_of(fn: Any) -> Any:
    """The `Policy` of a `train_step` or `filter_offload` function, or `None`."""
    if isinstance(fn, TrainStep):
        return fn.policy
    fn = _compat.inside_filter_jit(fn)
    return fn.policy if isinstance(fn, Offloaded) else None


def abstract_arguments(
    fn: Any, args: tuple, kwargs: dict, where: Where, platform: str
) -> tuple[tuple, dict]:
    """The arguments as abstract values on the target's devices. On a slice, the
    batch a `train_step` with `Policy(batch=...)` lays out is not replicated."""

    def to_abstract(tree: Any, replicate: bool = True) -> Any:
        def leaf(x: Any) -> Any:
            out = abstract(x, where.mesh, where.source, replicate)
            if platform == "gpu" and replicate and kind_of(out) != kind_of(x):
                raise kind_not_kept(where.name, kind_of(x))
            return out

        return jtu.tree_map(lambda x: leaf(x) if is_arraylike(x) else x, tree)

    if isinstance(fn, TrainStep) and fn.policy.batch is not None and where.is_slice:
        args = to_abstract(args[:2]) + to_abstract(args[2:], replicate=False)
    else:
        args = to_abstract(args)
    return args, to_abstract(kwargs)


def kind_not_kept(target: str, kind: str) -> NotImplementedError:
    return NotImplementedError(
        f"`memory_report(target={target!r})`: an argument in {kind} would be "
        f"compiled into device memory (JAX {jax.__version__} keeps no memory kind on "
        "compile-only GPU devices, and eqx_offload's workaround, checked on jax "
        f"{_compat.JAX_VERSION}, did not hold here), so the report would be wrong: "
        "report for a TPU target, or on the GPU itself (`target=None`)."
    )


def split_estimate(stats: Any, lowered: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Device and host parts on a backend with one memory.

    Arguments and outputs go by the memory kinds of the compiled signature.
    Temporaries are on the device. Aliased are only the donated inputs that share an
    output's memory kind. A device with two memories cannot alias across them.
    """
    arg_bytes = [nbytes(a) for a in jtu.tree_leaves(lowered.args_info)]
    signature = _compiler_stablehlo.signature(lowered.as_text(), len(arg_bytes))
    arg_kinds, aliases, out_kinds = signature
    out_bytes = [nbytes(o) for o in jtu.tree_leaves(lowered.out_info)]
    parts: dict[str, dict[str, int]] = {
        kind: dict.fromkeys(PARTS, 0) for kind in ("device", "host")
    }
    for kind, n in zip(arg_kinds, arg_bytes, strict=True):
        parts[kind]["argument"] += n
    for kind, n in zip(out_kinds, out_bytes, strict=True):
        parts[kind]["output"] += n
    for i, j in aliases.items():
        if arg_kinds[i] == out_kinds[j]:
            parts[arg_kinds[i]]["alias"] += arg_bytes[i]
    parts["device"]["temp"] = int(stats.temp_size_in_bytes)
    return parts["device"], parts["host"]
