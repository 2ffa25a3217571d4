"""`DoesNotFit`: the error `memory_report` raises for a program too big for one
device of its target, with what is known of it as data."""

import functools
from typing import Any

from .. import _compiler
from ._record import ResidualRow


class DoesNotFit(ValueError):
    """Raised by `memory_report` when the compiler finds the program too big for the
    target's memory. The message gives the compiler's numbers and what is known
    without compiling; so do the attributes:

    - `target`: what it was compiled for (`"tpu-v5e"`, ...).
    - `required_bytes`, `available_bytes`: the compiler's figures (`None` if its
        message had none); on a GPU, the footprint and the allocator's share.
    - `params`, `opt_state`: bytes of parameters and optimizer state by memory kind
        (`train_step` and `filter_offload` objects; `None` otherwise).
    - `residuals`: bytes saved for the backward pass by checkpoint name and memory
        kind, as traced (`None` when not a `train_step`/`filter_offload`).
    - `arguments`: bytes of each argument by memory kind.
    - `compiler_message`: the compiler's own words.
    - `tried`: raised by `eo.plan`, every candidate it considered (a `PlanTable`:
        `print(e.tried)`); `None` otherwise.
    """

    target: str
    required_bytes: int | None
    available_bytes: int | None
    params: dict[str, int] | None
    opt_state: dict[str, int] | None
    residuals: tuple[ResidualRow, ...] | None
    arguments: dict[str, dict[str, int]]
    compiler_message: str
    tried: Any

    def __init__(
        self,
        message: str,
        *,
        target: str,
        compiler_message: str,
        arguments: dict[str, dict[str, int]],
        params: dict[str, int] | None = None,
        opt_state: dict[str, int] | None = None,
        residuals: tuple[ResidualRow, ...] | None = None,
        sizes: tuple[int | None, int | None] | None = None,
    ):
        super().__init__(message)
        self.target = target
        self.compiler_message = compiler_message
        found = sizes or _compiler.oom_sizes(compiler_message)
        self.required_bytes, self.available_bytes = found
        self.arguments = arguments
        self.params = params
        self.opt_state = opt_state
        self.residuals = residuals
        self.tried = None

    def __reduce__(self) -> tuple:
        """Pickled whole, figures and all (`plan` receives it from a child process)."""
        rebuild = functools.partial(
            type(self),
            target=self.target,
            compiler_message=self.compiler_message,
            arguments=self.arguments,
            params=self.params,
            opt_state=self.opt_state,
            residuals=self.residuals,
            sizes=(self.required_bytes, self.available_bytes),
        )
        return rebuild, (str(self),), {"tried": self.tried}
