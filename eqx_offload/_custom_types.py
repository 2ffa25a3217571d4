"""Type aliases shared by signatures, in one place (as Equinox's `_custom_types.py`).

`_layout.Rule`/`Rules` stay beside `FSDP`, the class they name."""

from typing import Literal

from jax.sharding import AbstractMesh, Mesh


MemoryKind = Literal["device", "pinned_host", "unpinned_host"]
# What a `Policy(params=...)` may say: one kind for every leaf, or pattern -> kind.
ParamsSpec = None | str | tuple[tuple[str, str], ...]
# A mesh with devices, or one without (compiling ahead of time).
AnyMesh = Mesh | AbstractMesh
# Which way a `Transfer` moves bytes.
Direction = Literal["host_to_device", "device_to_host"]
