"""Imported first by `quickstart.py`: JAX on this machine's CPU where it has no GPU
or TPU, and without the notices JAX's CUDA plugin prints there.

- `JAX_PLATFORMS=cpu` (unless set) where no NVIDIA or Google PCI device is found,
  as JAX itself looks for TPUs: with libtpu installed (the `tpu` extra) JAX would
  otherwise probe for a TPU, and it also lets `--target` compile for a TPU or GPU
  that is not there.
- With the CUDA plugin installed (the `gpu-aot` extra, for `--target gpu-h100`), its
  C++ extensions log "Could not find cuda drivers on your machine, GPU will not be
  used." to stderr as JAX imports them and as JAX starts, four times, and no
  logging setting silences them. JAX is imported and started here with those lines
  (and absl's note before each) dropped from what is written to stderr; everything
  else written there meanwhile is passed on.
"""

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path


def accelerator_here() -> bool:
    """Whether this machine has an NVIDIA GPU or a Google TPU (by the vendor ids of
    its PCI devices)."""
    vendors = set()
    for path in Path("/sys/bus/pci/devices").glob("*/vendor"):
        with contextlib.suppress(OSError):
            vendors.add(path.read_text().strip())
    return bool(vendors & {"0x10de", "0x1ae0"})  # NVIDIA, Google


@contextlib.contextmanager
def without_cuda_driver_lines() -> Iterator[None]:
    """Drops the CUDA plugin's "Could not find cuda drivers" lines from what is
    written to stderr (file descriptor 2, where C++ writes) meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(True)
            drivers = ["Could not find cuda drivers" in line for line in lines]
            for line, is_driver, next_is_driver in zip(
                lines, drivers, drivers[1:] + [False]
            ):
                # Each such line comes after absl's note that logging is not set up.
                preamble = next_is_driver and "absl::InitializeLog()" in line
                if not (is_driver or preamble):
                    sys.stderr.write(line)


if not accelerator_here():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with without_cuda_driver_lines():
        import jax

        jax.devices()  # JAX starts, loading its plugins (after any config set)
