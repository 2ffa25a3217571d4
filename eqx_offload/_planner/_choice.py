"""How `plan` chooses among the compiled candidates that fit: within the error the
step-time model has shown, not by its raw estimate; and which of its stages are
experimental (off unless asked for)."""

from collections.abc import Iterable, Sequence
from typing import get_args, Literal, NamedTuple

from .._errors import see


# The stages whose gain rests on an overlap of host transfers (or host compute)
# with device work that no measurement has shown (on an H200 nothing overlapped):
# `Policy(prefetch=1)`, `Policy(update_timing="next_forward")` and
# `Policy(update="host")`. `plan(experimental=...)` turns them on.
Experimental = Literal["prefetch", "next_forward", "host_update"]
EXPERIMENTAL: tuple[Experimental, ...] = get_args(Experimental)
# The `Policy` field each sets, and to what (a candidate's `Settings` too).
SETS: dict[Experimental, tuple[str, object]] = {
    "host_update": ("update", "host"),
    "prefetch": ("prefetch", 1),
    "next_forward": ("update_timing", "next_forward"),
}


def experimental_names(
    value: Sequence[Experimental] | Experimental,
) -> frozenset[Experimental]:
    """The experimental stages asked for (`plan(experimental=...)`): a sequence of
    their names, or one name; anything else is a `ValueError` naming the
    argument and the names allowed."""
    one = isinstance(value, str) or not isinstance(value, Iterable)
    names = (value,) if one else tuple(value)
    if bad := [n for n in names if n not in EXPERIMENTAL]:
        raise ValueError(
            f"`plan(experimental={value!r})`: {', '.join(map(repr, bad))} is not an "
            f"experimental stage. Give some of {', '.join(map(repr, EXPERIMENTAL))} "
            "(e.g. `experimental=('prefetch',)`), or `()` for none." + see(118)
        )
    return frozenset(names)  # pyright: ignore[reportReturnType]


# Device memory left free beyond this share of the device budget counts no more
# in a tie: past it, the faster estimate wins. Without that cap, a tie would go to
# the candidate that offloads the most (it leaves the most room), which is the
# kind of step the model has under-priced (on the H200 it priced offloading
# steps at 0.31-0.66 of their measured time, device-only ones at 0.72-0.85).
ENOUGH_HEADROOM = 0.1


class Option(NamedTuple):
    """One compiled candidate that fits, as the choice sees it.

    - `seconds`: its estimated step time (0 where there is none: the CPU backend).
    - `error`: how far that estimate can be off, relative
        (`MemoryReport.time.error`: a measured step is expected within `seconds ×
        (1 ± error)`).
    - `headroom`: the device bytes it leaves free: the device budget (less the
        workspace margin) less its device footprint.
    - `experimental`: the experimental stages it uses (`EXPERIMENTAL`).
    """

    seconds: float
    error: float
    headroom: float
    experimental: tuple[str, ...] = ()


def tied(options: Sequence[Option]) -> list[int]:
    """The options tied with the fastest (by estimate; the most headroom among
    equal estimates): those whose estimate exceeds the fastest's by at most the
    larger of the two errors, as a share of the fastest's: `seconds - fastest <=
    max(error, fastest_error) * fastest`. The fastest is one of them. Every option
    is compared with the fastest, not with each other, so the set is well defined
    (the relation "within the error of" is not transitive)."""
    if not options:
        return []
    fastest = min(options, key=lambda o: (o.seconds, -o.headroom))
    return [
        i
        for i, o in enumerate(options)
        if o.seconds - fastest.seconds <= max(o.error, fastest.error) * fastest.seconds
    ]


def choose(options: Sequence[Option], enough: float = float("inf")) -> int:
    """The index of the option `plan` chooses. Of those tied with the fastest
    (`tied`): one without an experimental stage if there is one; then the one
    with the most headroom, counted up to `enough` bytes (`ENOUGH_HEADROOM` of the
    device budget); then the fastest; then the most headroom."""
    return min(
        tied(options),
        key=lambda i: (
            bool(options[i].experimental),
            -min(options[i].headroom, enough),
            options[i].seconds,
            -options[i].headroom,
        ),
    )
