"""Compile targets for `memory_report`: this backend, one chip of a TPU, or a whole
TPU slice, compiled ahead of time on this machine with libtpu; one NVIDIA GPU, a
node of them or several nodes, with JAX's CUDA plugin (no TPU or GPU needed)."""

import functools
import importlib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .. import _compat, _mesh, _paths
from .._errors import see
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

# The GPUs: XLA's target configuration of each (`gpu_specs/`), which states its
# device memory (`device_memory_size`: 79.1 GiB for an H100 SXM, 141.0 GiB for an
# H200).
GPU_SPECS = {"gpu-h100": "h100_sxm.txtpb", "gpu-h200": "h200.txtpb"}

# The share of a GPU's memory JAX's allocator takes (and a program may use): 75% by
# default, `XLA_PYTHON_CLIENT_MEM_FRACTION` otherwise. The XLA:GPU compiler does not
# refuse a program too big for the device, so `memory_report` compares with this.
DEFAULT_MEM_FRACTION = 0.75

# A target is a chip name, or a chip name and a slice's topology: "tpu-v5e:4x4";
# for GPUs, GPUs per host or hosts x GPUs per host: "gpu-h100:8", "gpu-h100:4x8".
# Checked by `parse`, with the valid forms in the message (a `Literal` cannot spell
# the topologies).
_TARGET = re.compile(r"(?P<chip>[\w-]+?)(?::(?P<topology>\d+(?:x\d+)*))?")
_FORMS = (
    f"None (this backend), {_paths.quoted(TOPOLOGIES)} (one chip), a whole slice "
    "as chip and topology, e.g. 'tpu-v5e:2x2' ... 'tpu-v5e:16x16', 'tpu-v6e:4x4', "
    f"'tpu-v5p:2x2x2', 'tpu-v4:2x2x2'; {_paths.quoted(GPU_SPECS)} (one GPU), a node "
    "as GPU and GPUs per host, e.g. 'gpu-h100:8', or several nodes as hosts x GPUs "
    "per host, e.g. 'gpu-h100:4x8'"
)


def parse(target: str) -> tuple[str, str | None]:
    """The chip and the slice topology of `target`: `("tpu-v5e", "4x4")` for
    `"tpu-v5e:4x4"`, `("tpu-v5e", None)` for one chip, `("gpu-h100", "4x8")` for
    four hosts of eight H100s, `("gpu-h100", "8")` for one."""
    found = _TARGET.fullmatch(target) if isinstance(target, str) else None
    chip, topology = found.group("chip", "topology") if found else (None, None)
    # A TPU slice's topology has an "x"; a GPU target's at most one.
    xs = -1 if topology is None else topology.count("x")
    if not (chip in TOPOLOGIES and xs != 0 or chip in GPU_SPECS and xs <= 1):
        raise ValueError(
            f"`memory_report(target={target!r})`: unknown target; valid targets: "
            f"{_FORMS}." + see(51)
        )
    return chip, topology


# The targets `fewest_chips` tries for each chip, fewest devices first: one chip,
# then the slices of whole hosts (v5e/v6e: 4-chip VMs, then 8-chip hosts; v5p/v4:
# 4-chip hosts), or for a GPU one, two, four, a node of eight, then nodes of eight.
SIZES = {
    "tpu-v5e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "tpu-v6e": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "tpu-v5p": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8"),
    "tpu-v4": ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8"),
    "gpu-h100": ("2", "4", "8", "2x8", "4x8", "8x8"),
    "gpu-h200": ("2", "4", "8", "2x8", "4x8", "8x8"),
}


def target_sizes(chip: str) -> tuple[str, ...]:
    """The targets of `chip` from one device up (`SIZES`)."""
    if chip not in SIZES:
        raise ValueError(
            f"`fewest_chips(chip={chip!r})` is not a chip kind. Use one of "
            f"{_paths.quoted(SIZES)}." + see(119)
        )
    return (chip,) + tuple(f"{chip}:{t}" for t in SIZES[chip])


def device_count(target: str) -> int:
    """How many devices `target` compiles for: a slice's devices (two per v4 chip),
    the GPUs of its hosts; 1 for one chip or GPU."""
    return 1 if parse(target)[1] is None else len(devices(target))


def platform(target: str) -> str:
    """The compiler `target` is compiled with: `"tpu"` or `"gpu"`."""
    return "gpu" if parse(target)[0] in GPU_SPECS else "tpu"


def _gpu_spec(chip: str) -> str:
    return (Path(__file__).parent / "gpu_specs" / GPU_SPECS[chip]).read_text()


def capacity(target: str) -> int:
    """The device memory one program may use on one device of `target`: what libtpu
    states for a TPU; for a GPU, its memory as its target configuration states it
    times the share JAX's allocator takes (`XLA_PYTHON_CLIENT_MEM_FRACTION`,
    default 0.75)."""
    chip, _ = parse(target)
    if chip in HBM_BYTES:
        return HBM_BYTES[chip]
    found = re.search(r"device_memory_size: (\d+)", _gpu_spec(chip))
    assert found is not None, GPU_SPECS[chip]
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        share = DEFAULT_MEM_FRACTION if fraction is None else float(fraction)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(
            f"`memory_report`: `XLA_PYTHON_CLIENT_MEM_FRACTION` is {fraction!r}, "
            "not in (0, 1]. Set a fraction, or unset it."
        )
    return int(int(found[1]) * share)


# JAX's GPU client takes pinned host memory (`pinned_host` arrays, and what a program
# keeps there) from one pool per process, capped at `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`
# GiB: 64, or 16 with `XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE` (XLA's
# `GetGpuHostAllocator`, `se_gpu_pjrt_client.cc`).
PINNED_CAP = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
HostLimit = Literal["RAM", "pinned host cap"]


def host_memory(target: str, ram: int) -> tuple[int, HostLimit]:
    """The host memory behind one device of `target`, and what bounds it: `ram`,
    the host's RAM per device; or for a GPU, where it is smaller, its share of JAX's
    pinned host memory cap (`PINNED_CAP`), one process driving a host's GPUs."""
    if platform(target) != "gpu":
        return ram, "RAM"
    preallocated = os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE", "").lower()
    given = os.environ.get(PINNED_CAP, "16" if preallocated in ("1", "true") else "64")
    if not given.isdigit():
        raise ValueError(
            f"`memory_report`: `{PINNED_CAP}` is {given!r}, not a whole number of "
            "GiB. Set one, or unset it."
        )
    share = int(given) * 2**30 // chips_per_host(target)
    return (share, "pinned host cap") if share < ram else (ram, "RAM")


def _import(names: tuple[str, ...], message: str) -> None:
    """Imports the first of `names` there is; else the `ImportError` `message`."""
    missing = None
    for name in names:
        try:
            importlib.import_module(name)
            return
        except ImportError as e:
            missing = e
    raise ImportError(message) from missing


@functools.cache
def _gpu_devices(chip: str, hosts: int, per_host: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            platform="cuda",
            target_config=_gpu_spec(chip),
            topology=f"1x{hosts}x{per_host}",
        )
    except NotImplementedError as e:
        # The CUDA plugin registers its compile-only topologies when it loads; on a
        # machine without CUDA it fails to load unless JAX runs on the CPU alone.
        raise RuntimeError(
            f"`memory_report(target='gpu-...')`: the CUDA plugin did not load ({e})."
            " Set `JAX_PLATFORMS=cpu` before importing JAX."
        ) from e
    return tuple(desc.devices)


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
    """The devices `target` compiles for: every device of a slice or of the GPU
    hosts, or the first chip of the smallest TPU topology, or one GPU."""
    chip, topology = parse(target)
    if chip in GPU_SPECS:
        # The CUDA 12 plugin (the `gpu-aot` extra) or, on a machine set up for CUDA
        # 13, that one: both register the same "cuda" platform.
        _import(
            ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"),
            "`memory_report(target='gpu-...')` needs JAX's CUDA plugin, which is not "
            "installed. Install it (no GPU or CUDA needed): `pip install "
            f"jax-cuda12-plugin=={jax.__version__} "
            f"jax-cuda12-pjrt=={jax.__version__}`, or from a clone, the `gpu-aot` "
            "extra: `pip install -e '.[gpu-aot]'`.",
        )
        sizes = [int(n) for n in (topology or "1").split("x")]
        hosts, per_host = sizes if len(sizes) == 2 else (1, sizes[0])
        try:
            return _gpu_devices(chip, hosts, per_host)
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(
                f"`memory_report(target={target!r})`: the CUDA plugin does not "
                f"compile for these GPUs ({e}). Use {chip!r} or '{chip}:8'."
            ) from e
    _import(
        ("libtpu",),
        "`memory_report(target=...)` needs libtpu, which is not installed. Install "
        f"it: `pip install 'jax[tpu]=={jax.__version__}'`, or from a clone of "
        "eqx_offload, its `tpu` extra: `pip install -e '.[tpu]'`." + see(52),
    )
    if topology is None:
        return _topology_devices(TOPOLOGIES[chip])[:1]
    name = f"{chip.removeprefix('tpu-')}:{topology}"
    try:
        return _topology_devices(name)
    except jax.errors.JaxRuntimeError as e:
        message = str(e).strip().removeprefix("INVALID_ARGUMENT: ").rstrip(".")
        raise ValueError(
            f"`memory_report(target={target!r})`: libtpu does not accept the "
            f"topology {name!r}: {message}. Use whole hosts ('{chip}:4x4'), or "
            f"{chip!r} for one chip." + see(81)
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
    n = len(devices(target))
    if like is None:
        return _slice_mesh(target, (n,), ("chips",), (AxisType.Auto,))
    if like.size != n:
        raise ValueError(
            f"`memory_report(target={target!r})`: the inputs are laid out on a mesh "
            f"of shape {dict(like.shape)} ({like.size} devices), but {target} has "
            f"{n} chips. Lay them out on a mesh of {n} devices." + see(82)
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
    sharding = getattr(x, "sharding", None)
    if mesh is None:
        if isinstance(x, jax.Array) and not x.committed:
            sharding = None  # placed by the jit, as when the step itself is called
        sharding = None if sharding is None else abstract_sharding(sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(sharding, NamedSharding):
        if source is not None and sharding.mesh == source:
            named = _compat.named_sharding(mesh, sharding.spec, kind_of(x))
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named)
    elif mesh.size > 1 and sharding is not None and len(sharding.device_set) > 1:
        raise ValueError(
            f"`memory_report(target=...)`: an argument of shape {tuple(x.shape)} has "
            f"a {type(sharding).__name__}. Lay it out with a `NamedSharding`."
        )
    if not replicate:
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    named = _compat.named_sharding(mesh, PartitionSpec(), kind_of(x))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named)


class Where(NamedTuple):
    """What `memory_report` compiles for."""

    name: str  # the target, or this backend's name
    mesh: Any  # the TPU mesh arguments are laid out on; None for this backend
    source: Any  # the mesh the arguments name (a slice target), or None
    chip_mesh: Any  # one chip of the target, to compile leaves alone on
    capacity: int | None
    chips: int | None
    chips_per_host: int | None

    @property
    def is_slice(self) -> bool:
        return self.chips is not None and self.chips > 1


def where_of(target: str | None, trees: Any) -> Where:
    """What `memory_report(..., target=target)` compiles for; a slice's mesh is
    that of the arguments `trees`."""
    if target is None:
        return Where(jax.default_backend(), None, None, None, None, None, None)
    _, topology = parse(target)
    first_chip, room = chip_mesh(target), capacity(target)
    if topology is None:
        return Where(target, first_chip, None, first_chip, room, 1, 1)
    source = _mesh.tree_mesh(trees, abstract=True)
    mesh = slice_mesh(target, source)
    chips, per_host = mesh.size, chips_per_host(target)
    return Where(target, mesh, source, first_chip, room, chips, per_host)
