"""Warnings attributed to the user's line, not the library's."""

import sys
import warnings


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning (a `UserWarning`, or `category`) attributed to the line that called
    into the library.

    That is the first frame outside this library, Equinox, JAX and a runtime type
    checker's wrappers. Equinox wraps module methods. JAX traces what the library
    calls while a step is jitted.
    """
    internal = ("eqx_offload.", "equinox.", "jax.", "jaxtyping.", "beartype.")
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_globals.get("__name__", "").startswith(internal)
        or frame.f_code.co_filename.startswith("<")
    ):
        frame = frame.f_back
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        frame.f_globals.get("__name__"),
        frame.f_globals.setdefault("__warningregistry__", {}),
    )
