"""Warnings attributed to the user's line, not the library's."""

import sys
import warnings


def warn_at_caller(message: str) -> None:
    """A `UserWarning` attributed to the first frame outside this library, Equinox
    (which wraps module methods), JAX (which traces what the library calls while
    a step is jitted) and a runtime type checker's wrappers: the line that called
    into the library."""
    internal = ("eqx_offload.", "equinox.", "jax.", "jaxtyping.", "beartype.")
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_globals.get("__name__", "").startswith(internal)
        or frame.f_code.co_filename.startswith("<")
    ):
        frame = frame.f_back
    warnings.warn_explicit(
        message,
        UserWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        frame.f_globals.get("__name__"),
        frame.f_globals.setdefault("__warningregistry__", {}),
    )
