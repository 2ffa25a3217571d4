"""Checkpoint names: which occurred while tracing, and which are residuals.

It also checks that a policy's names mean something.

What a configured `Stacked` learned about one layer is an `Occurrence`. It is
recorded while tracing. It is also attached to the checkpoint policy the
`Stacked` builds, so it travels inside the jaxpr, as a parameter of the
`checkpoint` equation. A scan that JAX serves from a cache (an inner `jax.jit`
traced before) records nothing, but its jaxpr still carries the occurrence.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

from . import _compat, _jaxpr, _paths
from ._errors import see
from ._policy import Policy


class Occurrence(NamedTuple):
    """What one configured `Stacked` saw while tracing one layer."""

    stacked: str  # path of the `Stacked`
    names: tuple[str, ...]  # checkpoint names inside the layer body
    residual_names: tuple[str, ...]  # those of them the backward pass needs


_ATTRIBUTE = "eqx_offload_occurrence"


@dataclasses.dataclass
class NameLog:
    """The `Occurrence`s of one traced function."""

    occurrences: list[Occurrence] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, closed_jaxpr: Any) -> "NameLog":
        """The occurrences inside a jaxpr, nested jaxprs included."""
        policies = map(_jaxpr.checkpoint_policy_of, _jaxpr.equations(closed_jaxpr))
        found = (getattr(policy, _ATTRIBUTE, None) for policy in policies)
        return cls([occurrence for occurrence in found if occurrence is not None])

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(n for o in self.occurrences for n in o.names))

    @property
    def residual_names(self) -> list[str]:
        residuals = (n for o in self.occurrences for n in o.residual_names)
        return list(dict.fromkeys(residuals))


_NOT_RESIDUAL = (
    "A layer's output is not one of its residuals: the next layer saves it as its "
    "input, `<path>.input`."
)


@dataclasses.dataclass(eq=False, repr=False)
class UnusedName(ValueError):
    """A `save`/`offload` entry of a policy that would do nothing.

    It matches no name that occurred (`matched` is empty), or only names that are
    not saved for the backward pass. `offered` are the residual names a policy can
    select instead, when known.
    """

    # Built positionally, its fields are its `args` too, so that it pickles (`plan`
    # receives it from a child process); its message is `__str__`.
    argument: str
    pattern: str
    matched: tuple[str, ...]
    seen: tuple[str, ...]
    offered: tuple[str, ...]

    @property
    def never_occurred(self) -> bool:
        return not self.matched

    def with_offered(self, offered: tuple[str, ...]) -> "UnusedName":
        """The same error, listing `offered` as the names that can be used."""
        return UnusedName(self.argument, self.pattern, self.matched, self.seen, offered)

    def __str__(self) -> str:
        entry = f"`Policy({self.argument}=...)` names {self.pattern!r}"
        usable = (
            f"Names this model offers (saved for the backward pass, so a policy can "
            f"select them): {_paths.quoted(self.offered, 12)}; "
            "`eqx_offload.checkpoint_names(loss_fn, *args)` lists them with their "
            "bytes."
        )
        if not self.offered:
            usable = (
                "Names are dotted paths from the argument holding the `Stacked` "
                "(e.g. 'blocks.input')."
            )
        if self.never_occurred:
            seen = _paths.quoted(self.seen) if self.seen else "(none: no `Stacked`)"
            number = 27 if _paths.is_literal(self.pattern) else 28
            link = see(number if self.seen else 29)
            return f"{entry}, which never occurred; names seen: {seen}. {usable}{link}"
        return (
            f"{entry}, which occurred ({_paths.quoted(self.matched)}) but is not "
            f"saved for the backward pass, so listing it does nothing. {_NOT_RESIDUAL} "
            f"{usable}" + see(30)
        )


def check(policy: Policy, log: NameLog) -> None:
    """Raises `UnusedName` unless every `save`/`offload` entry of `policy` applies.

    Each entry must match a name that occurred, and one of its matches must be a
    residual. Otherwise it would silently do nothing. The error lists the
    residual names this trace found.
    """
    seen, offered = tuple(log.names), tuple(log.residual_names)
    entries = [("offload", p) for p in policy.offload]
    if policy.save != "all":
        entries = [("save", p) for p in policy.save] + entries
    for argument, pattern in entries:
        matched = tuple(n for n in seen if _paths.matches(pattern, n))
        if not set(offered).intersection(matched):
            raise UnusedName(argument, pattern, matched, seen, offered)


_log: contextvars.ContextVar[NameLog | None] = contextvars.ContextVar(
    "eqx_offload_names", default=None
)


@contextlib.contextmanager
def collecting() -> Iterator[NameLog]:
    """Marks a `filter_offload` function being traced, and collects occurrences.

    The occurrences are those of the configured `Stacked`s traced meanwhile.
    """
    log = NameLog()
    token = _log.set(log)
    try:
        yield log
    finally:
        _log.reset(token)


def record(checkpoint_policy: Any, occurrence: Occurrence) -> None:
    """Attaches `occurrence` to the checkpoint policy built with it, and records it
    in the log being collected, if any."""
    _compat.tag_checkpoint_policy(checkpoint_policy, _ATTRIBUTE, occurrence)
    log = _log.get()
    if log is not None:
        log.occurrences.append(occurrence)


def is_inside() -> bool:
    """Whether a `filter_offload` function is being traced (`collecting`)."""
    return _log.get() is not None
