"""Checkpoint names: which occurred while tracing, which are residuals, and the
checks that a policy's names mean something.

What a configured `Stacked` learned about one layer (an `Occurrence`) is recorded
while tracing, and also attached to the checkpoint policy it builds, so that it
travels inside the jaxpr as a parameter of the `checkpoint` equation: a scan that
JAX serves from a cache (an inner `jax.jit` traced before) records nothing, but its
jaxpr still carries the occurrence.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax.extend.core as jex

from . import _paths
from ._policy import Policy


class Occurrence(NamedTuple):
    """What one configured `Stacked` saw while tracing one layer."""

    stacked: str  # path of the `Stacked`
    names: tuple[str, ...]  # checkpoint names inside the layer body
    residual_names: tuple[str, ...]  # those of them the backward pass needs
    nameable: tuple[str, ...]  # submodule paths a pattern could name


_ATTRIBUTE = "eqx_offload_occurrence"


def attach(checkpoint_policy: Any, occurrence: Occurrence) -> Any:
    setattr(checkpoint_policy, _ATTRIBUTE, occurrence)
    return checkpoint_policy


class NameLog:
    """The `Occurrence`s of one traced function."""

    def __init__(self):
        self.occurrences: list[Occurrence] = []

    @classmethod
    def of(cls, closed_jaxpr: Any) -> "NameLog":
        """The occurrences inside a jaxpr, nested jaxprs included."""
        log = cls()

        def visit(jaxpr: Any) -> None:
            for eqn in jaxpr.eqns:
                policy = eqn.params.get("policy")
                occurrence = getattr(policy, _ATTRIBUTE, None)
                if occurrence is not None:
                    log.occurrences.append(occurrence)
                for sub in jex.jaxprs_in_params(eqn.params):
                    visit(sub)

        visit(closed_jaxpr.jaxpr)
        return log

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(n for o in self.occurrences for n in o.names))

    @property
    def residual_names(self) -> list[str]:
        return list(
            dict.fromkeys(n for o in self.occurrences for n in o.residual_names)
        )

    @property
    def nameable(self) -> list[str]:
        return list(dict.fromkeys(n for o in self.occurrences for n in o.nameable))


def check(policy: Policy, log: NameLog) -> None:
    """Every `save`/`offload` entry of `policy` must match a name that occurred, and
    one of its matches must be a residual: otherwise it would silently do nothing."""
    seen = log.names
    residuals = set(log.residual_names)
    entries = [("offload", p) for p in policy.offload]
    if policy.save != "all":
        entries = [("save", p) for p in policy.save] + entries
    for argument, pattern in entries:
        matched = [n for n in seen if _paths.matches(pattern, n)]
        if not matched:
            hint = ""
            if log.nameable:
                hint = f"; names that can be used: {_paths.quoted(log.nameable)}"
            raise ValueError(
                f"`Policy({argument}=...)` names {pattern!r}, which never occurred; "
                f"names seen: {_paths.quoted(seen)}{hint}. Names are dotted paths from "
                "the argument holding the `Stacked` (e.g. 'blocks.input')."
            )
        if not residuals.intersection(matched):
            raise ValueError(
                f"`Policy({argument}=...)` names {pattern!r}, which occurred "
                f"({_paths.quoted(matched)}) but is not saved for the backward pass, "
                f"so listing it does nothing. A layer's output is not one of its "
                f"residuals; the carry entering the layer is. Names that are "
                f"residuals: {_paths.quoted(log.residual_names)}."
            )


_log: contextvars.ContextVar[NameLog | None] = contextvars.ContextVar(
    "eqx_offload_names", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[NameLog]:
    """Marks a `filter_offload` function being traced, and collects the
    occurrences of the configured `Stacked`s traced meanwhile."""
    log = NameLog()
    token = _log.set(log)
    try:
        yield log
    finally:
        _log.reset(token)


def record(occurrence: Occurrence) -> None:
    log = _log.get()
    if log is not None:
        log.occurrences.append(occurrence)


def is_inside() -> bool:
    return _log.get() is not None
