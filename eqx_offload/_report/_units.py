"""How reports write sizes, times, FLOP counts and devices."""


def device_word(target: str) -> str:
    """What one device of `target` is called: "GPU" for `gpu-*`, else "chip"."""
    return "GPU" if target.startswith("gpu-") else "chip"


def one_device(target: str, is_slice: bool) -> str:
    """One device of `target`, in words: "one tpu-v5e chip", "one GPU of
    gpu-h100:8" (of a slice)."""
    u = device_word(target)
    return f"one {u} of {target}" if is_slice else f"one {target} {u}"


def host_total(by_kind: dict[str, int]) -> int:
    """The bytes of `by_kind` (bytes by memory kind) that are not on the device."""
    return sum(v for k, v in by_kind.items() if k != "device")


def row(label: str, *cells: int | str | None) -> str:
    """A line of a report's table: `label`, then a column per cell (bytes as
    `size_text`, words as they are, `None` blank)."""
    shown = [
        c if isinstance(c, str) else "" if c is None else size_text(c) for c in cells
    ]
    return f"{label:<34}" + "".join(f"{c:>14}" for c in shown)


def header(label: str, *columns: str) -> list[str]:
    """A table's header line (`row`), underlined."""
    line = row(label, *columns)
    return [line, "-" * len(line)]


# Units, largest first: a figure takes the first it is at least one of (else the last).
_SIZES = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_TIMES = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
_FLOPS = (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("FLOP", 1))


def _scaled(
    n: float | int, units: tuple[tuple[str, float | int], ...], form: str
) -> str:
    unit, scale = next(((u, s) for u, s in units if n >= s), units[-1])
    return f"{n / scale:{form}} {unit}"


def size_text(n: int) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    return sign + (_scaled(n, _SIZES, ".2f") if n >= 2**10 else f"{n} B")


def time_text(seconds: float | int) -> str:
    return "0 s" if seconds == 0 else _scaled(seconds, _TIMES, ".3g")


def flops_text(n: float | int) -> str:
    return _scaled(n, _FLOPS, ".3g")
