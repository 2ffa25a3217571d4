"""What `plan` chooses between: a `Candidate` is one placement of a model's
parameters (per top-level field) and optimizer state (per part of each field's
state: `"nu:blocks"`; under a compute dtype, the compute copies of each field's
host parameters too) and one choice per
checkpoint name (saved, offloaded or recomputed), or no remat at all, with the
step's settings (FSDP over a mesh axis on a slice, the micro-batch count, the
compute dtype); it turns into the `Policy` that trains that way. Moves are the
one-knob changes that free device memory; `presets` are `Policy`'s presets as
candidates."""

from typing import Literal, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec

from .._layout import FSDP
from .._policy import Policy


Residual = Literal["save", "offload", "recompute"]
_CHOICES: tuple[Residual, ...] = ("save", "offload", "recompute")
Kind = Literal["device", "pinned_host"]


class Move(NamedTuple):
    """One knob turned: a field's parameters, a part of its state or the compute
    copies of its host parameters to a memory kind, or a checkpoint name to a
    choice."""

    knob: Literal["params", "opt_state", "stream", "copies", "residual"]
    # a top-level field, a part of a field's state, a vocabulary table (streamed
    # from the host, `Policy(host_tables=...)`, when "pinned_host"), a field whose
    # compute copies move, or a checkpoint name
    name: str
    to: str  # "device", "pinned_host"; "save", "offload" or "recompute"


class Settings(NamedTuple):
    """How the step runs, apart from where things live: FSDP over a mesh axis (a
    slice target) with the batch split over it, the micro-batch count, the
    compute dtype (`None`: the model's own), whether the TPU compiler keeps
    what it rematerializes on the host (`Policy(host_remat=True)`), and where
    the optimizer update runs (`Policy(update=...)`: `"auto"`, streamed through
    the device where state is on the host, or `"host"`, on the host's CPU),
    how many layers ahead a `Stacked` reads (`Policy(prefetch=...)`), and when
    the stacked layers' update is applied (`Policy(update_timing=...)`: `"now"`,
    or `"next_forward"`, in the next step's forward scan)."""

    axis: str | None = None
    microbatches: int = 1
    compute_dtype: str | None = None
    host_remat: bool = False
    update: Literal["auto", "host"] = "auto"
    prefetch: int = 0
    update_timing: Literal["now", "next_forward"] = "now"

    @property
    def label(self) -> str:
        parts = []
        if self.update == "host":
            parts.append("update on host")
        if self.microbatches != 1:
            parts.append(f"{self.microbatches} micro-batches")
        if self.compute_dtype is not None:
            parts.append(f"{self.compute_dtype} compute")
        if self.host_remat:
            parts.append("compiler remat to host")
        if self.prefetch:
            parts.append("layers read ahead")
        if self.update_timing == "next_forward":
            parts.append("update in the next forward")
        return ", ".join(parts)


class Candidate(NamedTuple):
    """A placement and a remat choice (what `Candidate.policy` trains with)."""

    params: tuple[tuple[str, Kind], ...]  # top-level field -> kind
    # a part of a field's state ("nu:blocks"), or a field's whole state -> kind
    opt_state: tuple[tuple[str, Kind], ...]
    # None: no remat at all (`Policy.none()`); else checkpoint name -> choice
    residuals: tuple[tuple[str, Residual], ...] | None
    settings: Settings = Settings()
    # a vocabulary table -> "pinned_host": kept on the host (`Policy(host_tables=)`)
    stream: tuple[tuple[str, Kind], ...] = ()
    # Under a compute dtype, a field's compute copies (`ComputeCopyState`: one for
    # each of its host parameters) -> "pinned_host": with their parameters, on
    # the host; "device": kept on the device while the parameters are on the host.
    # One entry for each field that has copies (`_sizes.copies_of`).
    copies: tuple[tuple[str, Kind], ...] = ()

    @classmethod
    def start(
        cls,
        fields: tuple[str, ...],
        slots: tuple[str, ...],
        settings: Settings,
        tables: tuple[str, ...] = (),
        copied: tuple[str, ...] = (),
    ) -> "Candidate":
        """Everything on the device, nothing recomputed: `Policy.none()`."""
        params: tuple[tuple[str, Kind], ...] = tuple((f, "device") for f in fields)
        state: tuple[tuple[str, Kind], ...] = tuple((s, "device") for s in slots)
        stream: tuple[tuple[str, Kind], ...] = tuple((t, "device") for t in tables)
        copies: tuple[tuple[str, Kind], ...] = tuple((f, "pinned_host") for f in copied)
        return cls(params, state, None, settings, stream, copies)

    def remat(self, names: tuple[str, ...]) -> "Candidate":
        """Every name recomputed, the placements unchanged: `Policy.remat()` of
        a candidate with everything on the device."""
        return self._replace(residuals=tuple((n, "recompute") for n in names))

    @property
    def microbatches(self) -> int:
        return self.settings.microbatches

    def with_settings(self, settings: Settings) -> "Candidate":
        """This placement in other settings (without a compute dtype, no copies
        are kept on the device)."""
        return self._replace(settings=settings)._normal()

    def _host(self, field: str) -> bool:
        """Whether some of a field's parameters are on the host (placed whole, in
        a part placed apart, or a table of it streamed): it has compute copies."""
        return any(
            field_of(n) == field and k != "device" for n, k in self.params + self.stream
        )

    def _normal(self) -> "Candidate":
        """Compute copies are kept on the device only of a field whose parameters
        are on the host, under a compute dtype: elsewhere they have none."""
        copies = tuple(
            (
                f,
                k
                if self.settings.compute_dtype is not None and self._host(f)
                else "pinned_host",
            )
            for f, k in self.copies
        )
        return self._replace(copies=copies)

    def apply(self, move: Move, names: tuple[str, ...]) -> "Candidate":
        """This candidate with `move` made (from no remat, a residual move first
        saves every other name, so that only this one changes)."""
        if move.knob == "residual":
            residuals = self.residuals
            if residuals is None:
                residuals = tuple((n, "save") for n in names)
            changed = tuple(
                (n, move.to if n == move.name else c)  # type: ignore[misc]
                for n, c in residuals
            )
            return self._replace(residuals=changed)
        if move.knob == "copies":
            copies = tuple(
                (f, move.to if f == move.name else k)  # type: ignore[misc]
                for f, k in self.copies
            )
            return self._replace(copies=copies)._normal()
        field = move.knob
        entries: tuple[tuple[str, Kind], ...] = getattr(self, field)
        if move.name not in dict(entries):  # a part of a field, placed apart
            entries += ((move.name, move.to),)  # type: ignore[assignment]
        kinds = dict(
            (f, move.to if f == move.name else k)  # type: ignore[misc]
            for f, k in entries
        )
        # A part placed as its field is no longer placed apart.
        kept = tuple(
            (f, k)
            for f, k in kinds.items()
            if field == "stream" or kinds.get(_parent(f) or "") != k
        )
        return self._replace(**{field: kept})._normal()

    def moves(self, names: tuple[str, ...]) -> list[Move]:
        """The one-knob changes from here that can free device memory."""
        out = [
            Move("params", f, "pinned_host") for f, k in self.params if k == "device"
        ]
        out += [
            Move("opt_state", f, "pinned_host")
            for f, k in self.opt_state
            if k == "device"
        ]
        out += [
            Move("stream", t, "pinned_host") for t, k in self.stream if k == "device"
        ]
        out += [
            Move("copies", f, "pinned_host") for f, k in self.copies if k == "device"
        ]
        current = dict(self.residuals or ())
        for n in names:
            choice = current.get(n, "save")
            if choice == "save":
                out += [
                    Move("residual", n, "offload"),
                    Move("residual", n, "recompute"),
                ]
        return out

    def flips(self, parts: dict[str, tuple[str, ...]]) -> list[Move]:
        """Every one-knob change from here, either way: a field's parameters or a
        part of its state to the other memory kind, a checkpoint name to another
        choice (not between no remat and remat); a part of a field
        (`parts`: `"blocks"` -> `"blocks.mlp"`, `"nu:blocks"` -> `"nu:blocks.mlp"`)
        placed apart from the rest of it, unless every other part already is (that
        is the field moved); and under a compute dtype, the compute copies of a
        field whose parameters are on the host to the other memory kind."""
        other: dict[str, Kind] = {"device": "pinned_host", "pinned_host": "device"}
        out = []
        out += [Move("stream", t, other[k]) for t, k in self.stream]
        for knob in ("params", "opt_state"):
            entries: tuple[tuple[str, Kind], ...] = getattr(self, knob)
            placed = dict(entries)
            out += [Move(knob, f, other[k]) for f, k in entries]
            out += [
                Move(knob, part, other[k])
                for f, k in entries
                for part in parts.get(f, ())
                if part not in placed
                and any(p not in placed for p in parts[f] if p != part)
            ]
        if self.settings.compute_dtype is not None:
            out += [
                Move("copies", f, other[k]) for f, k in self.copies if self._host(f)
            ]
        for n, c in self.residuals or ():
            out += [
                Move("residual", n, choice)
                for choice in ("save", "offload", "recompute")
                if choice != c
            ]
        return out

    def policy(self) -> Policy:
        axis, _, dtype, host_remat, update, prefetch, timing = self.settings
        streamed = tuple(t for t, k in self.stream if k != "device")
        if self.residuals is None:
            save: str | tuple[str, ...] = "all"
            offload: tuple[str, ...] = ()
        else:
            save = tuple(n for n, c in self.residuals if c == "save")
            offload = tuple(n for n, c in self.residuals if c == "offload")
        return Policy(
            save=save,
            offload=offload,
            params={**dict(self.params), **{t: "pinned_host" for t in streamed}},
            opt_state={**dict(self.opt_state), **self._copies()},
            shard=None if axis is None else FSDP(axis),
            batch=None if axis is None else PartitionSpec(axis),
            compute_dtype=None if dtype is None else np.dtype(dtype),
            host_remat=host_remat,
            host_tables=streamed,
            update=update,
            prefetch=prefetch,
            update_timing=timing,
        )

    @property
    def reads_from_host(self) -> bool:
        """Whether some parameters are on the host or some residual is offloaded:
        what a `Stacked` reads from the host inside its scans (`prefetch`)."""
        offloaded = self.residuals is not None and any(
            c == "offload" for _, c in self.residuals
        )
        return offloaded or any(k != "device" for _, k in self.params)

    @property
    def state_on_host(self) -> bool:
        """Whether some optimizer state is on the host (what `update="host"`
        updates there)."""
        return any(k != "device" for _, k in self.opt_state)

    def _copies(self) -> dict[str, Kind]:
        """The `Policy(opt_state=...)` patterns that place the compute copies: one
        `"copies:<field>"` for each field with copies (some parameters on the
        host), more specific than the field's own state pattern, which it would
        otherwise follow. Only patterns that name copies that exist: one naming
        none is an error."""
        if self.settings.compute_dtype is None:
            return {}
        return {f"copies:{f}": k for f, k in self.copies if self._host(f)}

    @property
    def label(self) -> str:
        """A short description: what differs from everything on the device and
        nothing recomputed."""
        parts = []
        host = [f for f, k in self.params if k != "device" and _parent(f) is None]
        if host:
            parts.append(f"params on host: {', '.join(host)}")
        state = _by_field(tuple((s, k) for s, k in self.opt_state if not _parent(s)))
        if state:
            parts.append(f"opt_state on host: {', '.join(state)}")
        apart = [
            f"{'params of ' if knob == 'params' else ''}"
            f"{'opt_state of ' if knob == 'opt_state' and ':' not in name else ''}"
            f"{name} on "
            f"{'device' if kind == 'device' else 'host'}"
            for knob in ("params", "opt_state")
            for name, kind in getattr(self, knob)
            if _parent(name) is not None
        ]
        if apart:
            parts.append(", ".join(apart))
        streamed = [t for t, k in self.stream if k != "device"]
        if streamed:
            parts.append(f"stream {', '.join(streamed)} from host")
        kept = [f for f, k in self.copies if k == "device"]
        if kept and self.settings.compute_dtype is not None:
            parts.append(f"compute copies of {', '.join(kept)} on device")
        if self.residuals is None:
            parts.append("no remat")
        else:
            # The shorter of the names saved and the names recomputed.
            by = {c: [n for n, x in self.residuals if x == c] for c in _CHOICES}
            if by["offload"]:
                parts.append(f"offload {', '.join(by['offload'])}")
            if not by["recompute"]:
                parts.append("save the rest" if by["offload"] else "save all")
            elif not by["save"]:
                parts.append("recompute the rest" if by["offload"] else "recompute all")
            elif len(by["save"]) <= len(by["recompute"]):
                parts.append(f"save {', '.join(by['save'])}")
            else:
                parts.append(f"recompute {', '.join(by['recompute'])}")
        if self.settings.label:
            parts.append(self.settings.label)
        return "; ".join(parts)


def presets(base: Candidate, names: tuple[str, ...]) -> list[tuple[str, Candidate]]:
    """`Policy.remat()`, `Policy.offload_residuals()` and `Policy.offload_all()` as
    candidates in `base`'s settings (`base` is `Policy.none()`), with their labels:
    each places what the preset places, compute copies included (`offload_all`'s
    are on the host with their parameters)."""
    remat = base.remat(names)
    inputs = tuple(n for n in names if n.endswith(".input"))
    offloaded = remat._replace(
        residuals=tuple(
            (n, "offload" if n in inputs else c) for n, c in remat.residuals or ()
        )
    )
    everything = offloaded._replace(
        params=tuple((f, "pinned_host") for f, _ in remat.params),
        opt_state=tuple((s, "pinned_host") for s, _ in remat.opt_state),
        copies=tuple((f, "pinned_host") for f, _ in remat.copies),
    )
    return [
        ("recompute all: Policy.remat()", remat),
        ("offload layer inputs: Policy.offload_residuals()", offloaded),
        ("all on host: Policy.offload_all()", everything),
    ]


def field_of(name: str) -> str:
    """The top-level field of a field, a part of it or a leaf path: `"blocks"` of
    `"blocks.mlp"` and of `"blocks.mlp.weight"`, `"layers"` of `"layers[0]"`."""
    return name.split(".", 1)[0].split("[", 1)[0]


def _parent(name: str) -> str | None:
    """The field (or field's state part) a part of a field belongs to:
    `"blocks"` of `"blocks.mlp"`, `"nu:blocks"` of `"nu:blocks.mlp"`; `None` for a
    whole field."""
    part, colon, path = name.rpartition(":")
    if "." not in path:
        return None
    return f"{part}{colon}{path.split('.', 1)[0]}"


def _by_field(slots: tuple[tuple[str, Kind], ...]) -> list[str]:
    """The host-resident state by field: `"blocks"` where all of its state is on
    the host, `"blocks (nu)"` where some of its parts are."""
    fields: dict[str, list[tuple[str | None, Kind]]] = {}
    for slot, kind in slots:
        part, _, field = slot.rpartition(":")
        fields.setdefault(field, []).append((part or None, kind))
    out = []
    for field, kinds in fields.items():
        host = [part for part, kind in kinds if kind != "device"]
        if len(host) == len(kinds):
            out.append(field)
        elif host:
            out.append(f"{field} ({', '.join(str(p) for p in host)})")
    return out
