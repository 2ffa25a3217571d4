"""Checkpoint names: which occurred while tracing, which are residuals, and the
checks that a policy's names mean something."""

from typing import NamedTuple

from . import _paths
from ._policy import Policy


class Occurrence(NamedTuple):
    """What one configured `Stacked` saw while tracing one layer."""

    stacked: str  # path of the `Stacked`
    names: tuple[str, ...]  # checkpoint names inside the layer body
    residual_names: tuple[str, ...]  # those of them the backward pass needs
    nameable: tuple[str, ...]  # submodule paths a pattern could name


class NameLog:
    """Collects `Occurrence`s while a `filter_offload` function is traced."""

    def __init__(self):
        self.occurrences: list[Occurrence] = []

    def record(self, occurrence: Occurrence) -> None:
        self.occurrences.append(occurrence)

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
