"""Every compile inside a `with compiles(options) as texts:` block: with these
compiler options too (the program's own kept), and each compiled program's text
appended to `texts`. JAX is imported only when the block starts (`gpu_check.py`'s
parent process never starts a backend)."""

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def compiles(options: dict | None = None) -> Iterator[list[str]]:
    import jax

    texts: list[str] = []
    compile_ = jax.stages.Lowered.compile

    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if options:
            kwargs["compiler_options"] = (
                kwargs.get("compiler_options") or {}
            ) | options
        compiled = compile_(self, *args, **kwargs)
        texts.append(compiled.as_text() or "")
        return compiled

    jax.stages.Lowered.compile = hooked
    try:
        yield texts
    finally:
        jax.stages.Lowered.compile = compile_
