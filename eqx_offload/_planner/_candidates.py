"""What `plan` chooses between. A `Candidate` places each top-level field's
parameters and each part of its optimizer state (a `Part`), and under a compute
dtype the compute copies of its host parameters. It makes one choice per
checkpoint name (saved, offloaded or recomputed), or no remat at all. Its
`Settings` are FSDP over a mesh axis, the micro-batch count and the compute
dtype. `Candidate.policy` is the `Policy` that trains that way. A `Move` turns one
knob; `presets` are `Policy`'s presets as candidates."""

from collections.abc import Iterable, Mapping
from typing import Any, cast, Literal, NamedTuple, TypeVar

import numpy as np
from jax.sharding import PartitionSpec

from .._custom_types import MemoryKind
from .._layout import FSDP
from .._policy import Policy
from ._choice import SETS


Residual = Literal["save", "offload", "recompute"]
_CHOICES: tuple[Residual, ...] = ("save", "offload", "recompute")
# What a move turns: a field's parameters or a part of them, a part of its
# optimizer state, a vocabulary table streamed from the host
# (`Policy(host_tables=...)`), a field's compute copies, or a checkpoint name.
Knob = Literal["params", "opt_state", "host_tables", "copies", "residual"]
_OTHER: dict[MemoryKind, MemoryKind] = {
    "device": "pinned_host",
    "pinned_host": "device",
}

_K = TypeVar("_K")
_V = TypeVar("_V")


class Placements(dict[_K, _V]):
    """A mapping never changed once made (`set` makes a changed copy), hashable,
    equal to another with the same items in the same order (as the `Policy` it
    becomes is ordered)."""

    @classmethod
    def fromkeys(  # pyright: ignore[reportIncompatibleMethodOverride]
        cls, keys: Iterable[_K], value: _V
    ) -> "Placements[_K, _V]":
        return cls((k, value) for k in keys)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placements):
            return NotImplemented
        return list(self.items()) == list(other.items())

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:  # pyright: ignore[reportIncompatibleVariableOverride]
        return hash(tuple(self.items()))

    def set(self, key: _K, value: _V) -> "Placements[_K, _V]":
        """A copy with `key` mapped to `value` (a new key goes last)."""
        return Placements({**self, key: value})


class Part(NamedTuple):
    """What a placement names: a top-level field (`Part("blocks")`) or a part of it
    one level down (`Part("blocks", "mlp")`). For optimizer state, `slot` names one
    part of the state (`"nu"`: Adam's second moment); `None` is all of it."""

    field: str
    child: str | None = None
    slot: str | None = None

    @property
    def whole(self) -> "Part":
        """The field, or the field's state slot, that this part belongs to."""
        return self._replace(child=None)

    @property
    def pattern(self) -> str:
        """The `Policy` pattern: `"blocks"`, `"blocks.mlp"`, `"nu:blocks.mlp"`."""
        path = self.field if self.child is None else f"{self.field}.{self.child}"
        return path if self.slot is None else f"{self.slot}:{path}"


class Move(NamedTuple):
    """One knob turned to a memory kind or a residual choice. `name` is a `Part`
    (parameters, state), a leaf path (a streamed table), a top-level field
    (compute copies) or a checkpoint name."""

    knob: Knob
    name: Part | str
    to: MemoryKind | Residual


class Settings(NamedTuple):
    """How the step runs, apart from where things live.

    - `axis`: FSDP over this mesh axis (a slice), with the batch split over it.
    - `microbatches`; `compute_dtype` (`None`: the model's own).
    - `host_remat`: the TPU compiler keeps what it rematerializes on the host.
    - `update`: where the optimizer update runs (`Policy(update=...)`).
    - `prefetch`: how many layers ahead a `Stacked` reads.
    - `update_timing`: `"next_forward"` applies the stacked layers' update in the
        next step's forward scan.
    """

    axis: str | None = None
    microbatches: int = 1
    compute_dtype: str | None = None
    host_remat: bool = False
    update: Literal["auto", "host"] = "auto"
    prefetch: int = 0
    update_timing: Literal["now", "next_forward"] = "now"

    @property
    def experimental(self) -> tuple[str, ...]:
        """The experimental stages (`plan(experimental=...)`) these settings use."""
        return tuple(
            stage
            for stage, (field, _) in SETS.items()
            if getattr(self, field) != getattr(Settings(), field)
        )

    @property
    def label(self) -> str:
        parts = [
            "update on host" if self.update == "host" else "",
            f"{self.microbatches} micro-batches" if self.microbatches != 1 else "",
            f"{self.compute_dtype} compute" if self.compute_dtype is not None else "",
            "compiler remat to host" if self.host_remat else "",
            "layers read ahead" if self.prefetch else "",
            "update in the next forward" if self.update_timing != "now" else "",
        ]
        return ", ".join(p for p in parts if p)


Kinds = Placements[Part, MemoryKind]


class Candidate(NamedTuple):
    """A placement and a remat choice (what `Candidate.policy` trains with).

    - `params`: top-level field or part of one -> memory kind.
    - `opt_state`: state slot of a field, or part of one -> memory kind.
    - `residuals`: checkpoint name -> choice; `None` is no remat (`Policy.none()`).
    - `host_tables`: vocabulary table -> `"pinned_host"` when streamed from the
        host (`Policy(host_tables=...)`).
    - `copies`: under a compute dtype, a field's compute copies of its host
        parameters -> memory kind (`"device"`: kept there while the parameters
        are on the host). One entry for each field with copies.
    """

    params: Kinds
    opt_state: Kinds
    residuals: Placements[str, Residual] | None
    settings: Settings = Settings()
    host_tables: Placements[str, MemoryKind] = Placements()
    copies: Placements[str, MemoryKind] = Placements()

    @classmethod
    def start(
        cls,
        fields: tuple[str, ...],
        slots: tuple[Part, ...],
        settings: Settings,
        tables: tuple[str, ...] = (),
        copied: tuple[str, ...] = (),
    ) -> "Candidate":
        """Everything on the device, nothing recomputed: `Policy.none()`."""
        return cls(
            Placements.fromkeys((Part(f) for f in fields), "device"),
            Placements.fromkeys(slots, "device"),
            None,
            settings,
            Placements.fromkeys(tables, "device"),
            Placements.fromkeys(copied, "pinned_host"),
        )

    def remat(self, names: tuple[str, ...]) -> "Candidate":
        """Every name recomputed, the placements unchanged."""
        return self._replace(residuals=Placements.fromkeys(names, "recompute"))

    def with_settings(
        self, settings: Settings | None = None, /, **changes: Any
    ) -> "Candidate":
        """This placement in other settings (`settings`, or its own), with `changes`
        (`Settings` fields)."""
        settings = (self.settings if settings is None else settings)._replace(**changes)
        return self._replace(settings=settings)._normal()

    def _host(self, field: str) -> bool:
        """Whether some of a field's parameters are on the host (whole, a part, or
        a streamed table): then it has compute copies."""
        params = any(p.field == field and k != "device" for p, k in self.params.items())
        return params or any(
            field_of(t) == field and k != "device" for t, k in self.host_tables.items()
        )

    def _normal(self) -> "Candidate":
        """Copies stay on the device only for a field with host parameters, under
        a compute dtype; elsewhere there are none."""
        cast = self.settings.compute_dtype is not None
        copies = Placements(
            (f, k if cast and self._host(f) else "pinned_host")
            for f, k in self.copies.items()
        )
        return self._replace(copies=copies)

    def apply(self, move: Move, names: tuple[str, ...]) -> "Candidate":
        """This candidate with `move` made. From no remat, a residual move first
        saves every other name."""
        if move.knob == "residual":
            assert isinstance(move.name, str)
            residuals = self.residuals or Placements.fromkeys(names, "save")
            moved = residuals.set(move.name, cast(Residual, move.to))
            return self._replace(residuals=moved)
        moved = getattr(self, move.knob).set(move.name, move.to)
        if move.knob in ("params", "opt_state"):
            # A part placed as its field is no longer placed apart.
            moved = Placements(
                (p, k)
                for p, k in moved.items()
                if p.child is None or moved.get(p.whole) != k
            )
        return self._replace(**{move.knob: moved})._normal()

    def moves(self, names: tuple[str, ...]) -> list[Move]:
        """The one-knob changes from here that can free device memory."""
        out = [
            Move(knob, n, "pinned_host")
            for knob in ("params", "opt_state", "host_tables", "copies")
            for n, k in getattr(self, knob).items()
            if k == "device"
        ]
        current = self.residuals or {}
        for n in names:
            if current.get(n, "save") == "save":
                out += [Move("residual", n, c) for c in ("offload", "recompute")]
        return out

    def flips(self, parts: Mapping[Part, tuple[Part, ...]]) -> list[Move]:
        """Every one-knob change from here, either way (not between no remat and
        remat). A part of a field (`parts`: whole -> its parts) is placed apart
        unless every other part already is: that is the field moved. Under a
        compute dtype, the copies of a field with host parameters move too."""
        out = [Move("host_tables", t, _OTHER[k]) for t, k in self.host_tables.items()]
        for knob in ("params", "opt_state"):
            placed: Kinds = getattr(self, knob)
            out += [Move(knob, p, _OTHER[k]) for p, k in placed.items()]
            out += _parts_apart(knob, placed, parts)
        if self.settings.compute_dtype is not None:
            out += [
                Move("copies", f, _OTHER[k])
                for f, k in self.copies.items()
                if self._host(f)
            ]
        for n, c in (self.residuals or {}).items():
            out += [Move("residual", n, other) for other in _CHOICES if other != c]
        return out

    def policy(self) -> Policy:
        s = self.settings
        dtype = None if s.compute_dtype is None else np.dtype(s.compute_dtype)
        on_host = tuple(t for t, k in self.host_tables.items() if k != "device")
        by = _by_choice(self.residuals)
        params: dict[str, MemoryKind] = {p.pattern: k for p, k in self.params.items()}
        params |= {t: "pinned_host" for t in on_host}
        state: dict[str, MemoryKind] = {p.pattern: k for p, k in self.opt_state.items()}
        if s.compute_dtype is not None:  # the copies that exist (else an error)
            state |= {f"copies:{f}": k for f, k in self.copies.items() if self._host(f)}
        return Policy(
            save="all" if self.residuals is None else by["save"],
            offload=by["offload"],
            params=params,
            opt_state=state,
            shard=None if s.axis is None else FSDP(s.axis),
            batch=None if s.axis is None else PartitionSpec(s.axis),
            compute_dtype=dtype,
            host_remat=s.host_remat,
            host_tables=on_host,
            update=s.update,
            prefetch=s.prefetch,
            update_timing=s.update_timing,
        )

    @property
    def label(self) -> str:
        """A short description: what differs from `Policy.none()`."""
        return "; ".join(p for p in _labels(self) if p)


def _parts_apart(
    knob: Knob, placed: Kinds, parts: Mapping[Part, tuple[Part, ...]]
) -> list[Move]:
    """Each part of a placed whole, to the other kind, while some other part of
    that whole is not placed apart."""
    return [
        Move(knob, part, _OTHER[k])
        for whole, k in placed.items()
        for part in parts.get(whole, ())
        if part not in placed
        and any(p not in placed for p in parts[whole] if p != part)
    ]


def _labels(c: Candidate) -> list[str]:
    """What a label says (`""`: nothing): of the placements, the fields and state
    on the host, parts placed apart, streamed tables, compute copies kept on the
    device; then of the residuals, and of the settings."""
    host = [p.pattern for p, k in c.params.items() if k != "device" and p.child is None]
    state = _by_field([(p, k) for p, k in c.opt_state.items() if p.child is None])
    apart = [
        _apart(knob, p, k)
        for knob in ("params", "opt_state")
        for p, k in getattr(c, knob).items()
        if p.child is not None
    ]
    tables = [t for t, k in c.host_tables.items() if k != "device"]
    cast = c.settings.compute_dtype is not None
    kept = [f for f, k in c.copies.items() if k == "device" and cast]
    return [
        _listed("params on host: ", host),
        _listed("opt_state on host: ", state),
        ", ".join(apart),
        _listed("stream ", tables, " from host"),
        _listed("compute copies of ", kept, " on device"),
        _residual_label(c.residuals),
        c.settings.label,
    ]


def _listed(before: str, names: list[str], after: str = "") -> str:
    """`names` listed between `before` and `after`; nothing without names."""
    return f"{before}{', '.join(names)}{after}" if names else ""


def _apart(knob: str, part: Part, kind: MemoryKind) -> str:
    """A part placed apart: `"params of blocks.mlp on host"`, `"opt_state of
    blocks.mlp on device"` (all of its state), `"nu:blocks.mlp on host"`."""
    whose = f"{knob} of " if knob == "params" or part.slot is None else ""
    return f"{whose}{part.pattern} on {'device' if kind == 'device' else 'host'}"


def _residual_label(residuals: Mapping[str, Residual] | None) -> str:
    """The offloaded names, and the shorter of the names saved and recomputed."""
    if residuals is None:
        return "no remat"
    by = _by_choice(residuals)
    offload, save, recompute = by["offload"], by["save"], by["recompute"]
    if save and recompute:  # the shorter list, saved if as short
        verb = "save" if len(save) <= len(recompute) else "recompute"
        rest = f"{verb} {', '.join(by[verb])}"
    else:  # the one choice left: of the rest, or of all
        verb = "recompute" if recompute else "save"
        rest = f"{verb} {'the rest' if offload else 'all'}"
    return "; ".join([f"offload {', '.join(offload)}", rest] if offload else [rest])


def _by_choice(residuals: Mapping[str, Residual] | None) -> dict[str, tuple[str, ...]]:
    """The names of each choice (`"save"`, ...), in order; none for no remat."""
    pairs = (residuals or {}).items()
    return {c: tuple(n for n, x in pairs if x == c) for c in _CHOICES}


def presets(
    base: Candidate, names: tuple[str, ...], offered: Iterable[Settings] = ()
) -> list[tuple[str, Candidate]]:
    """`Policy.remat()`, `Policy.offload_residuals()` and `Policy.offload_all()` as
    candidates in `base`'s settings (`base` is `Policy.none()`), with their labels.
    Each places what its preset places, compute copies included. Then, in each of
    the `offered` settings with a compute dtype (and `base`'s micro-batches), the
    masters and their optimizer state on the host and the compute copies on the
    device, every name recomputed: the placement for a large batch per update,
    which the local search seldom reaches one knob at a time."""
    remat = base.remat(names)
    inputs: Placements[str, Residual] = Placements(
        (n, "offload" if n.endswith(".input") else "recompute") for n in names
    )
    offloaded = remat._replace(residuals=inputs)
    everything = offloaded._replace(
        params=Placements.fromkeys(remat.params, "pinned_host"),
        opt_state=Placements.fromkeys(remat.opt_state, "pinned_host"),
        copies=Placements.fromkeys(remat.copies, "pinned_host"),
    )
    kept = everything._replace(
        residuals=remat.residuals, copies=Placements.fromkeys(remat.copies, "device")
    )
    return [
        ("recompute all: Policy.remat()", remat),
        ("offload layer inputs: Policy.offload_residuals()", offloaded),
        ("all on host: Policy.offload_all()", everything),
    ] + [
        (_COPIES_KEPT, kept.with_settings(s, microbatches=base.settings.microbatches))
        for s in offered
        if s.compute_dtype is not None and kept.copies
    ]


_COPIES_KEPT = (
    "compute copies on device, the rest on host: Policy.remat(params='pinned_host', "
    "opt_state={'**': 'pinned_host', 'copies:**': 'device'})"
)


def field_of(path: str) -> str:
    """The top-level field of a leaf path: `"blocks"` of `"blocks.mlp.weight"`,
    `"layers"` of `"layers[0]"`."""
    return path.split(".", 1)[0].split("[", 1)[0]


def _by_field(slots: list[tuple[Part, MemoryKind]]) -> list[str]:
    """The host-resident state by field: `"blocks"` where all of its state is on
    the host, `"blocks (nu)"` where some of its slots are."""
    out = []
    for field in dict.fromkeys(part.field for part, _ in slots):
        kinds = [(part.slot, kind) for part, kind in slots if part.field == field]
        if host := [str(slot) for slot, kind in kinds if kind != "device"]:
            whole = len(host) == len(kinds)
            out.append(field if whole else f"{field} ({', '.join(host)})")
    return out
