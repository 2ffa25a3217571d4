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
    if spec is None or isinstance(spec, str):
        return ["device" if s.owner is None else spec or "device" for s in leaves]
    # The patterns by the state part they name (None: every part, `"blocks"`).
    parts: dict[str | None, list[tuple[str, str]]] = {None: []}
    for p, k in spec:
        part, pattern = p.split(":", 1) if ":" in p else (None, p)
        parts.setdefault(part, []).append((pattern, k))
    used = {
        part: dict.fromkeys((p for p, _ in ps), False) for part, ps in parts.items()
    }
    paths = [leaf.path for leaf in param_leaves]

    def best(path: str, part: str | None) -> tuple[str, str] | None:
        return _paths.best_match(path, parts[part], where, used[part], see(17))

    by_param = [best(path, None) for path in paths]
    _paths.check_used(used.pop(None), paths, where, see(18))

    def kind(s: StateLeaf) -> str:
        """The kind of the best pattern for `s`'s parameter, or for its part."""
        if s.owner is None or s.owner_path is None:
            return "device"
        found = by_param[s.owner]
        named = best(s.owner_path, s.part) if s.part in used else None
        if named is not None and (
            found is None
            or _paths.specificity(named[0]) >= _paths.specificity(found[0])
        ):
            found = named
        return "device" if found is None else found[1]

    out = [kind(s) for s in leaves]
    _check_parts(parts, used, leaves, paths, where)
    return out


def _check_parts(
    parts: dict[str | None, list[tuple[str, str]]],
    used: dict[str | None, dict[str, bool]],
    leaves: list[StateLeaf],
    paths: list[str],
    where: str,
) -> None:
    """Raises a `ValueError` for a state part the state does not have, or a
    part's parameter pattern that matches no parameter."""
    have = list(dict.fromkeys(s.part for s in leaves if s.part is not None))
    for part in used:
        if part not in have:
            patterns = _paths.quoted(f"{part}:{p}" for p, _ in parts[part])
            raise ValueError(
                f"{where}: pattern(s) {patterns} name the state part {part!r}, "
                "which this optimizer's state lacks. Its parameter-shaped parts are "
                f"{_paths.quoted(have)}." + see(116)
            )
        unused = {f"{part}:{p}": hit for p, hit in used[part].items()}
        _paths.check_used(unused, paths, where, see(18))
