"""How reports write sizes, times, FLOP counts and devices."""


def device_word(target: str) -> str:
    """What one device of `target` is called: "GPU" for `gpu-*`, else "chip"."""
    return "GPU" if target.startswith("gpu-") else "chip"


def size_text(n: int) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n} B"


def time_text(seconds: float | int) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return "0 s" if seconds == 0 else f"{seconds / 1e-9:.3g} ns"


def flops_text(n: float | int) -> str:
    for unit, scale in (
        ("PFLOP", 1e15),
        ("TFLOP", 1e12),
        ("GFLOP", 1e9),
        ("MFLOP", 1e6),
    ):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"
