"""Which memory kind `Policy(opt_state=...)` gives each optimizer-state leaf.

A pattern names parameters (`"blocks"`, `"**"`): it places every part of their
state. A pattern `"<part>:<parameters>"` names one part of the state as well
(`"nu:**"`: Adam's second moment of every parameter), the field of the optimizer's
state that holds that copy of the parameters (`mu`, `nu`, `trace`, ...). For each
state leaf the pattern that names its parameter most precisely wins (most literal
characters, as for `params`); of two equally precise ones, the one that names the
state part wins. State that is not parameter-shaped (step counts) stays on the
device."""

from .. import _paths
from .._errors import see
from .._memory_kinds import ParamsSpec
from ._state_tree import StateLeaf


def split_spec(
    spec: ParamsSpec,
) -> tuple[ParamsSpec, dict[str, list[tuple[str, str]]]]:
    """The patterns of `Policy(opt_state=spec)` that name parameters only, and
    those that name a state part (`"nu:**"`), by part."""
    if spec is None or isinstance(spec, str):
        return spec, {}
    plain = tuple((p, k) for p, k in spec if ":" not in p)
    parts: dict[str, list[tuple[str, str]]] = {}
    for p, k in spec:
        if ":" in p:
            part, pattern = p.split(":", 1)
            parts.setdefault(part, []).append((pattern, k))
    return plain, parts


def state_leaf_kinds(
    spec: ParamsSpec,
    leaves: list[StateLeaf],
    param_leaves: list[_paths.Leaf],
    where: str,
) -> list[str]:
    """The memory kind `Policy(opt_state=spec)` gives each state leaf: the kind of
    the best pattern for its parameter (and part), `"device"` where none matches
    and for state that is not parameter-shaped. A pattern that matches nothing is
    a `ValueError`, as is a part this optimizer's state does not have."""
    where = f"{where} (`Policy(opt_state=...)`)"
    plain, parts = split_spec(spec)
    if plain is None or isinstance(plain, str):
        return ["device" if s.owner is None else plain or "device" for s in leaves]
    items = plain
    general_used = dict.fromkeys((p for p, _ in items), False)
    by_param = [
        _paths.best_match(leaf.path, items, where, general_used, see(17))
        for leaf in param_leaves
    ]
    _paths.check_used(
        general_used, [leaf.path for leaf in param_leaves], where, see(18)
    )
    used = {
        part: dict.fromkeys((p for p, _ in ps), False) for part, ps in parts.items()
    }
    out = []
    for s in leaves:
        if s.owner is None:
            out.append("device")
            continue
        best = by_param[s.owner]
        if s.part in parts and s.owner_path is not None:
            named = _paths.best_match(
                s.owner_path, parts[s.part], where, used[s.part], see(17)
            )
            if named is not None and (
                best is None
                or _paths.specificity(named[0]) >= _paths.specificity(best[0])
            ):
                best = named
        out.append("device" if best is None else best[1])
    _check_parts(parts, used, leaves, param_leaves, where)
    return out


def _check_parts(
    parts: dict[str, list[tuple[str, str]]],
    used: dict[str, dict[str, bool]],
    leaves: list[StateLeaf],
    param_leaves: list[_paths.Leaf],
    where: str,
) -> None:
    """Raises a `ValueError` for a state part the state does not have, or a
    part's parameter pattern that matches no parameter."""
    have = list(dict.fromkeys(s.part for s in leaves if s.part is not None))
    for part in parts:
        if part not in have:
            patterns = _paths.quoted(f"{part}:{p}" for p, _ in parts[part])
            raise ValueError(
                f"{where}: pattern(s) {patterns} name the state part {part!r}, "
                "which this optimizer's state lacks. Its parameter-shaped parts are "
                f"{_paths.quoted(have)}." + see(116)
            )
        unused = {f"{part}:{p}": hit for p, hit in used[part].items()}
        _paths.check_used(unused, [leaf.path for leaf in param_leaves], where, see(18))
