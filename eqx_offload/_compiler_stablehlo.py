"""Reading a lowered function's StableHLO (`jax.jit(f).lower(...).as_text()`):
the memory kind of each argument and output of its `main`, and which output each
donated argument aliases.

Not a stable interface: checked against jax 0.10.2, with samples in
`tests/fixtures/0.10.2/` that `tests/test_compiler_text.py` parses and compares
with what this installation writes (as `_compiler.py`'s).
"""

import re
from typing import NamedTuple


class Signature(NamedTuple):
    """The signature of a lowered function's `main`."""

    arg_kinds: list[str]  # "device" or "host", per argument
    aliases: dict[int, int]  # donated argument -> the output it aliases
    out_kinds: list[str]  # "device" or "host", per output


def signature(text: str, arguments: int | None = None) -> Signature:
    """From the StableHLO of a lowered function: each argument's memory kind, which
    output each donated argument aliases, and each output's memory kind.

    `arguments`: how many arguments the function has. JAX 0.10 passes the large
    constants a program closes over (a mask made outside the step) as more
    arguments of `main`, before the function's own: those are dropped."""
    start = text.index("func.func public @main(")
    body = text[start : text.index(") {", text.index(") -> (", start)) + 1]
    args_text, outs_text = body.split(") -> (", 1)

    def attributes(part: str, marker: str) -> list[str]:
        out = []
        for match in re.finditer(marker, part):
            i = match.end()
            depth, j, quoted = 0, i, False
            while j < len(part) and (quoted or depth or part[j] not in ",)"):
                if part[j] == '"' and part[j - 1] != "\\":
                    quoted = not quoted  # a sharding string: "{devices=[8]<=[8]}"
                elif not quoted:
                    depth += {"<": 1, ">": -1, "{": 1, "}": -1}.get(part[j], 0)
                j += 1
            out.append(part[i:j])
        return out

    def kind(attrs: str) -> str:
        found = re.search(r'mhlo\.memory_kind = "(\w+)"', attrs)
        return "host" if found and found[1] != "device" else "device"

    arg_attrs = attributes(args_text, r"%arg\d+: ")
    if arguments is not None and len(arg_attrs) > arguments:
        arg_attrs = arg_attrs[len(arg_attrs) - arguments :]
    out_attrs = attributes(outs_text, r"(?:^|, )(?=tensor<)")
    arg_kinds, out_kinds = [kind(a) for a in arg_attrs], [kind(a) for a in out_attrs]
    aliases = {
        i: int(found[1])
        for i, attrs in enumerate(arg_attrs)
        if (found := re.search(r"tf\.aliasing_output = (\d+)", attrs))
    }
    # A program over a mesh marks donated arguments `jax.buffer_donor` and lets the
    # compiler pick the output each one aliases: the first free output of the same
    # type in the same memory.
    taken = set(aliases.values())
    for i, attrs in enumerate(arg_attrs):
        if i in aliases or "jax.buffer_donor = true" not in attrs:
            continue
        for j, out in enumerate(out_attrs):
            # (the `tensor<...>` type each text starts with)
            same = out.split(" ", 1)[0] == attrs.split(" ", 1)[0]
            if j not in taken and same and out_kinds[j] == arg_kinds[i]:
                aliases[i] = j
                taken.add(j)
                break
    return Signature(arg_kinds, aliases, out_kinds)
