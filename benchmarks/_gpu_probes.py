"""`gpu_check.py`'s probes of the host link (`--calibrate`, `--overlap`), its saved
programs, and its reading of a profile.

Everything JAX here is imported inside the functions: the parent process of
`gpu_check.py` never starts a backend (each part runs in a child process of its
own, and only there is the GPU taken).

- `save_program`: a compiled program's text (`_compiles.compiles` keeps it),
  gzip-compressed, beside the results.
- `link`: the probes, each a small jitted program timed alone and beside its
  counterpart (median of `runs` after one warm-up): a `pinned_host` -> device
  copy, a device -> `pinned_host` copy, both at once, a matmul chain, a copy beside
  the chain, and (`slices=True`) the same bytes read as dynamic slices of a host
  stack inside a loop, at an offset affine in the loop counter and at a clamped
  one.
- `calibration`: the calibration file (`Hardware.from_measurements` reads it) from
  those probes and the host update's measured rate.
- `profile`, `stream_events_*`, `overlap_shares`: one step under `jax.profiler`,
  the memcpy and kernel events of its `Stream #` lines, and the share of copy time
  that overlaps kernels and of host -> device time that overlaps device -> host.
"""

import bisect
import datetime
import gzip
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


FORMAT = "eqx_offload calibration"
VERSION = 1
# Device kind prefix -> the hardware table's row the calibration refines.
TARGETS = {"NVIDIA H100": "gpu-h100", "NVIDIA H200": "gpu-h200"}
# Pieces of the host stack the loop probes slice (8, as the probe has).
PIECES = 8


# --- Saved programs ---------------------------------------------------------------


def slug(text: str) -> str:
    """A file name's part: `"offload_all, streamed update"` -> `offload-all-...`."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def save_program(text: str, path: str | Path) -> str:
    """`text` gzip-compressed into `path` (its folder made); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return str(path)


# --- The link probes ---------------------------------------------------------------


def _timed(
    fn: Any, args: tuple, runs: int, program: Path | None
) -> dict[str, float | str]:
    """`fn(*args)` compiled (its text saved to `program`), run once to warm up,
    then `runs` times: median and min seconds."""
    import jax

    compiled = fn.lower(*args).compile()
    out: dict[str, float | str] = {}
    if program is not None:
        out["program"] = save_program(compiled.as_text(), program)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    out["s median"] = statistics.median(times)
    out["s min"] = min(times)
    return out


def overlap_share(alone: tuple[float, float], both: float) -> float:
    """The share of the shorter part hidden when both run in one program:
    `(t_a + t_b - t_both) / min(t_a, t_b)`, clipped to [0, 1] (0: one after the
    other; 1: the shorter entirely under the longer)."""
    a, b = alone
    share = (a + b - both) / min(a, b)
    return min(1.0, max(0.0, share))


def _pair(name_a: str, a: dict, name_b: str, b: dict, both: dict) -> dict[str, Any]:
    """Two parts timed alone and together, with the share that overlapped."""
    ta, tb, tboth = a["s median"], b["s median"], both["s median"]
    return {
        f"{name_a} alone s": ta,
        f"{name_b} alone s": tb,
        "both s": tboth,
        "sum of parts s": ta + tb,
        "larger part s": max(ta, tb),
        "overlap share": overlap_share((ta, tb), tboth),
        "programs": [x.get("program") for x in (a, b, both) if x.get("program")],
    }


def _device() -> Any:
    """Device memory, as a traced function names it (as the library does)."""
    import jax

    return jax.memory.Space.Device


def _host() -> Any:
    """Host memory, likewise."""
    import jax

    return jax.memory.Space.Host


def _chain(a: Any, w: Any, n: int) -> Any:
    """`n` dependent matmuls."""
    for _ in range(n):
        a = a @ w
    return a


class _Probes:
    """The probe programs over one host stack of `PIECES` pieces (`mib` MiB in
    all) and one `dim` x `dim` bf16 matmul."""

    def __init__(self, mib: int, dim: int, runs: int, programs: Path | None):
        import jax
        import jax.numpy as jnp
        import numpy as np

        device = jax.devices()[0]
        self.kind = device.device_kind
        self.on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        self.on_host = jax.sharding.SingleDeviceSharding(
            device, memory_kind="pinned_host"
        )
        columns = 2**16
        rows = max(1, mib * 2**20 // (4 * columns * PIECES))
        stack = np.ones((PIECES, rows, columns), np.float32)
        self.host = jax.device_put(stack, self.on_host)
        self.device = jax.device_put(stack, self.on_device)
        self.bytes = int(stack.nbytes)
        rng = np.random.default_rng(0)
        w = rng.standard_normal((dim, dim), np.float32) / math.sqrt(dim)
        self.a = jax.device_put(jnp.asarray(w, jnp.bfloat16), self.on_device)
        self.w = jax.device_put(jnp.asarray(w.T, jnp.bfloat16), self.on_device)
        self.dim, self.runs, self.programs = dim, runs, programs
        self.matmuls = 1

    def time(self, name: str, fn: Callable, *args: Any) -> dict:
        """`fn` jitted (its name the program's, `probe_<name>`) and timed."""
        import jax

        fn.__name__ = f"probe_{slug(name).replace('-', '_')}"
        program = None
        if self.programs is not None:
            program = self.programs / f"probe-{slug(name)}.hlo.gz"
        return _timed(jax.jit(fn), args, self.runs, program)

    def h2d(self) -> dict:
        import jax

        return self.time("h2d", lambda x: jax.device_put(x, _device()), self.host)

    def d2h(self) -> dict:
        import jax

        return self.time("d2h", lambda y: jax.device_put(y, _host()), self.device)

    def both_ways(self) -> dict:
        import jax

        def both(x: Any, y: Any) -> Any:
            return jax.device_put(x, _device()), jax.device_put(y, _host())

        return self.time("both ways", both, self.host, self.device)

    def matmul(self, n: int) -> dict:
        return self.time(f"matmul x{n}", lambda a, w: _chain(a, w, n), self.a, self.w)

    def copy_beside_matmul(self) -> dict:
        import jax

        def both(x: Any, a: Any, w: Any) -> Any:
            return jax.device_put(x, _device()), _chain(a, w, self.matmuls)

        return self.time("h2d beside matmul", both, self.host, self.a, self.w)

    def loop(self, offset: str, slices: bool, matmuls: bool) -> dict:
        """A loop of `PIECES` steps, each reading piece `offset(i)` of the host
        stack into piece `i` of a stack on the device (`slices`: nothing computed
        on it, so that the read stays a transfer of its own) and running its share
        of the matmul chain (`matmuls`), independent of each other. `offset`: `"i"`
        (a `scan` over `arange`, as the library's piece and prefetching loops),
        `"i, fori_loop"` (the loop counter itself), `"xs"` (a `scan` over the host
        stack itself, as over stacked layers) or `"min(i+1, n-1)"` (clamped: the
        last step reads its piece again)."""
        import jax
        import jax.numpy as jnp

        n, per_step = PIECES, max(1, math.ceil(self.matmuls / PIECES))

        def step(i: Any, carry: tuple, x: Any, w: Any) -> tuple:
            ys, a = carry
            if slices:
                j = jnp.minimum(i + 1, n - 1) if offset.startswith("min") else i
                piece = jax.lax.dynamic_index_in_dim(x, j, keepdims=True)
                piece = jax.device_put(piece, _device())
                ys = jax.lax.dynamic_update_slice_in_dim(ys, piece, i, 0)
            if matmuls:
                a = _chain(a, w, per_step)
            return ys, a

        def over_xs(x: Any, a: Any, w: Any) -> Any:
            def body(a: Any, piece: Any) -> tuple[Any, Any]:
                return _chain(a, w, per_step) if matmuls else a, jax.device_put(
                    piece, _device()
                )

            a, ys = jax.lax.scan(body, a, x)
            return ys, a

        def loop(x: Any, a: Any, w: Any) -> Any:
            ys = jnp.zeros(x.shape if slices else (1,), x.dtype)
            if offset.endswith("fori_loop"):
                return jax.lax.fori_loop(0, n, lambda i, c: step(i, c, x, w), (ys, a))

            def body(carry: tuple, i: Any) -> tuple[tuple, None]:
                return step(i, carry, x, w), None

            return jax.lax.scan(body, (ys, a), jnp.arange(n))[0]

        parts = [p for p, on in (("slices", slices), ("matmuls", matmuls)) if on]
        name = f"loop {offset} {' '.join(parts)}"
        fn = over_xs if offset == "xs" and slices else loop
        return self.time(name, fn, self.host, self.a, self.w)


def link(
    mib: int, dim: int, matmul_s: float, runs: int, slices: bool, programs: str
) -> dict[str, Any]:
    """The probes: each copy alone and both directions at once, the matmul chain
    (about `matmul_s` long) alone and beside a copy, and, with `slices`, the loops
    that read the same bytes as dynamic slices; their programs saved under
    `programs` (none if empty)."""
    import os

    import jax

    p = _Probes(mib, dim, runs, Path(programs) if programs else None)
    out: dict[str, Any] = {"backend": jax.default_backend(), "device": p.kind}
    out.update({"bytes": p.bytes, "runs": runs})
    out["CUDA_DEVICE_MAX_CONNECTIONS"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    h2d, d2h, both = p.h2d(), p.d2h(), p.both_ways()
    out["host -> device GB/s"] = p.bytes / h2d["s median"] / 1e9
    out["device -> host GB/s"] = p.bytes / d2h["s median"] / 1e9
    out["both ways GB/s"] = 2 * p.bytes / both["s median"] / 1e9
    out["(d) host -> device beside device -> host"] = _pair(
        "host -> device", h2d, "device -> host", d2h, both
    )
    # The chain's length from a short one's rate: about `matmul_s` in all.
    if matmul_s > 0:
        per = p.matmul(4)["s median"] / 4
        p.matmuls = max(1, round(matmul_s / per))
    chain = p.matmul(p.matmuls)
    flops = 2 * p.dim**3 * p.matmuls
    out["matmul"] = {
        "dim": p.dim,
        "matmuls": p.matmuls,
        "flops": flops,
        "bf16 flop/s": flops / chain["s median"],
    }
    out["(a) host -> device copy beside a matmul chain"] = _pair(
        "copy", h2d, "matmul chain", chain, p.copy_beside_matmul()
    )
    if slices:
        out.update(_loops(p))
    return out


def _loops(p: _Probes) -> dict[str, Any]:
    """Probes (b) and (c): the same bytes as `PIECES` slices of the host stack read
    in a loop, each beside the loop's matmuls alone."""
    matmuls = p.loop("i", slices=False, matmuls=True)
    out: dict[str, Any] = {}
    for label, offset in (
        ("(b) slices at offset i read from a scan over arange (the library's)", "i"),
        ("(b') slices at offset i, the fori_loop counter", "i, fori_loop"),
        ("(b'') slices at offset i, a scan over the host stack itself", "xs"),
        ("(c) slices at offset min(i+1, n-1) (clamped, not affine)", "min(i+1, n-1)"),
    ):
        alone = p.loop(offset, slices=True, matmuls=False)
        both = p.loop(offset, slices=True, matmuls=True)
        row = _pair("slices", alone, "loop matmuls", matmuls, both)
        row["slices GB/s"] = p.bytes / alone["s median"] / 1e9
        out[label] = row
    return out


# --- The calibration file --------------------------------------------------------


def target(device_kind: str, backend: str) -> str | None:
    """The hardware table's row a calibration on `device_kind` refines."""
    if backend == "cpu":
        return "cpu"
    for prefix, name in TARGETS.items():
        if device_kind.startswith(prefix):
            return name
    return None


def host_rate(host_update: dict[str, Any]) -> float | None:
    """The host update's memory rate (bytes/s): the first form of host compute
    that ran (the library's)."""
    for row in host_update.get("forms", {}).values():
        if row.get("host memory GB/s"):
            return row["host memory GB/s"] * 1e9
    return None


def calibration(
    probes: dict[str, Any],
    host_update: dict[str, Any],
    backend: str,
    versions: dict[str, Any],
) -> dict[str, Any]:
    """The calibration file's object (`Hardware.from_measurements` reads it)."""
    copy = probes.get("(a) host -> device copy beside a matmul chain", {})
    fields = {
        "host_to_device_bytes_per_second": _gb(probes.get("host -> device GB/s")),
        "device_to_host_bytes_per_second": _gb(probes.get("device -> host GB/s")),
        "both_ways_bytes_per_second": _gb(probes.get("both ways GB/s")),
        "transfer_overlap": copy.get("overlap share"),
        "host_memory_bytes_per_second": host_rate(host_update),
        "matmul_flops_bf16": probes.get("matmul", {}).get("bf16 flop/s"),
    }
    device = probes.get("device", "")
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": target(device, backend),
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions,
        **fields,
        "details": {"link probes": probes, "host update": host_update},
    }


def _gb(rate: float | None) -> float | None:
    return None if rate is None else rate * 1e9


def missing(calibration: dict[str, Any]) -> list[str]:
    """The rate fields of `calibration` not measured (not finite and positive, or an
    overlap outside [0, 1])."""
    out = []
    for key, value in calibration.items():
        if not key.endswith(("_per_second", "_bf16")) and key != "transfer_overlap":
            continue
        bad = not isinstance(value, (int, float)) or not math.isfinite(value)
        if key == "transfer_overlap":
            bad = bad or not 0.0 <= value <= 1.0
        elif not bad:
            bad = value <= 0
        if bad:
            out.append(key)
    return out


# --- The parameters of two runs -----------------------------------------------------


def parameters(model: Any, losses: list[float], check: dict[str, str]) -> dict:
    """The parameters and losses after the warm-up steps, saved to `check["save"]`
    (a `.npz`), or compared with those saved at `check["against"]`."""
    import equinox as eqx
    import jax
    import numpy as np

    leaves = [
        np.asarray(jax.device_get(x))
        for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    ]
    if "save" in check:
        np.savez(check["save"], *leaves, losses=np.asarray(losses))
        return {"saved": check["save"], "leaves": len(leaves), "losses": losses}
    with np.load(check["against"]) as saved:
        theirs = [saved[f"arr_{i}"] for i in range(len(leaves))]
        their_losses = saved["losses"].tolist()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves, theirs))
    return {
        "against": check["against"],
        "losses": losses,
        "reference losses": their_losses,
        "max |params - reference|": diff,
        "equal": all(np.array_equal(a, b) for a, b in zip(leaves, theirs)),
        # A hundredth of one step's update (learning rate 1e-4).
        "close (1e-6)": diff <= 1e-6 and np.allclose(losses, their_losses, rtol=1e-5),
    }


# --- One profiled step ------------------------------------------------------------


def profile(
    once: Callable[[Any], Any], state: Any, directory: str, steps: int = 3
) -> dict[str, Any]:
    """`state = once(state)` (one step, blocking) twice to warm up, `steps` times
    timed, then once under `jax.profiler.trace(directory)`; the profile's copy and
    kernel events read back (`overlap_shares`)."""
    import jax

    for _ in range(2):
        state = once(state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state = once(state)
        times.append(time.perf_counter() - start)
    out: dict[str, Any] = {"step s median (not profiled)": statistics.median(times)}
    start = time.perf_counter()
    try:
        with jax.profiler.trace(directory):
            state = once(state)
    except Exception as e:  # recorded: the timing stands without it
        out["error"] = f"profiling: {type(e).__name__}: {e}"[-2000:]
        return out
    out["profiled step and export s"] = time.perf_counter() - start
    try:
        out.update(read_profile(Path(directory)))
    except Exception as e:  # recorded: the timing stands without it
        out["error"] = f"reading the profile: {type(e).__name__}: {e}"[-2000:]
    return out


def read_profile(directory: Path) -> dict[str, Any]:
    """The `Stream #` events of the newest profile under `directory`: from its
    `.xplane.pb` (`jax.profiler.ProfileData`), else its `.trace.json.gz`."""
    found = sorted(directory.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    errors = []
    if found:
        try:
            events = stream_events_xplane(found[-1])
            return {"source": str(found[-1]), **overlap_shares(events)}
        except Exception as e:  # the trace JSON next
            errors.append(f"{found[-1].name}: {type(e).__name__}: {e}")
    traces = sorted(directory.rglob("*trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if traces:
        events = stream_events_trace_json(traces[-1])
        return {"source": str(traces[-1]), **overlap_shares(events), "errors": errors}
    return {"error": "no .xplane.pb or trace.json.gz written", "errors": errors}


# (line, event name, start s, end s, details)
Event = tuple[str, str, float, float, str]


def stream_events_xplane(path: Path) -> list[Event]:
    """The events on the device planes' `Stream #` lines of an `.xplane.pb`."""
    import jax

    data = jax.profiler.ProfileData.from_file(str(path))
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream #"):
                continue
            for e in line.events:
                details = ""
                for key, value in e.stats:
                    if key == "memcpy_details":
                        details = str(value)
                start = e.start_ns / 1e9
                out.append(
                    (line.name, e.name, start, start + e.duration_ns / 1e9, details)
                )
    return out


def stream_events_trace_json(path: Path) -> list[Event]:
    """The same from a trace viewer's `.trace.json.gz` (threads named `Stream #`)."""
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        (e.get("pid"), e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    out = []
    for e in events:
        line = names.get((e.get("pid"), e.get("tid")), "")
        if e.get("ph") == "X" and line.startswith("Stream #"):
            start = float(e["ts"]) / 1e6
            details = str(e.get("args", {}).get("memcpy_details", ""))
            out.append((line, e["name"], start, start + float(e["dur"]) / 1e6, details))
    return out


def _kind(name: str) -> str:
    for kind in ("H2D", "D2H"):
        if name.startswith("Memcpy") and kind in name:
            return kind
    if name.startswith(("Memcpy", "Memset")):
        return "other copy"
    return "kernel"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(start: float, end: float, union: list[tuple[float, float]]) -> float:
    """How much of [start, end] the disjoint, sorted `union` covers."""
    i = max(0, bisect.bisect_right(union, (start, math.inf)) - 1)
    total = 0.0
    while i < len(union) and union[i][0] < end:
        total += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
        i += 1
    return total


def overlap_shares(events: list[Event]) -> dict[str, Any]:
    """From a profile's `Stream #` events: time per kind and stream, the share of
    copy (H2D, D2H) time that overlaps kernels on any stream, the share of H2D
    time that overlaps D2H, and the copies staged through pageable memory."""
    if not events:
        return {
            "note": "no `Stream #` events: no GPU activity recorded (a CPU "
            "backend, or no CUPTI)"
        }
    by_kind: dict[str, list[tuple[float, float]]] = {}
    streams: dict[str, dict[str, int]] = {}
    slices = 0.0
    for line, name, start, end, _ in events:
        kind = _kind(name)
        by_kind.setdefault(kind, []).append((start, end))
        streams.setdefault(line, {}).setdefault(kind, 0)
        streams[line][kind] += 1
        if kind == "kernel" and "dynamic" in name and "slice" in name:
            slices += end - start
    kernels = _union(by_kind.get("kernel", []))
    d2h = _union(by_kind.get("D2H", []))
    copies = by_kind.get("H2D", []) + by_kind.get("D2H", [])
    copy_s = sum(e - s for s, e in copies)
    h2d_s = sum(e - s for s, e in by_kind.get("H2D", []))
    under_kernels = sum(_covered(s, e, kernels) for s, e in copies)
    under_d2h = sum(_covered(s, e, d2h) for s, e in by_kind.get("H2D", []))
    first = min(e[2] for e in events)
    last = max(e[3] for e in events)
    return {
        "events": len(events),
        "span s": last - first,
        "streams (events by kind)": streams,
        "H2D s": h2d_s,
        "D2H s": copy_s - h2d_s,
        "kernel busy s": sum(e - s for s, e in kernels),
        "dynamic-slice kernels s": slices,
        "copy time overlapping kernels": under_kernels / copy_s if copy_s else None,
        "H2D time overlapping D2H": under_d2h / h2d_s if h2d_s else None,
        "pageable or synchronous copies": sum(
            1 for e in events if "pageable" in e[4] or "async:0" in e[4]
        ),
    }


# --- In the parent process ----------------------------------------------------------

# The probes' sizes: MiB copied, the matmul's dimension, the chain's length in
# seconds (0: one matmul), timed runs.
LINK = {"mib": 1024, "dim": 8192, "matmul_s": 0.04, "runs": 5}
LINK_SMOKE = {"mib": 4, "dim": 64, "matmul_s": 0.0, "runs": 2}
# The first GPU run's measured step times (an H200): "before".
BEFORE = Path(__file__).parent / "results" / "gpu_check_h200_gpt02b.json"
Run = Callable[..., dict[str, Any]]  # `gpu_check.run_child`


def programs_folder(json_path: Path) -> Path:
    """Where the programs of the results written to `json_path` go:
    `<stem>.programs/` beside it."""
    return json_path.with_name(json_path.stem + ".programs")


def relative(path: str | Path, json_path: Path) -> str:
    """`path` as the results at `json_path` name it: from their folder."""
    import os

    return Path(
        os.path.relpath(Path(path).resolve(), json_path.parent.resolve())
    ).as_posix()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def describe(label: str, row: dict[str, Any], where: str) -> str:
    """One probe pair as a line: each part alone, both, the overlap share."""
    if "overlap share" not in row:
        return f"{label}: {row.get('error', row)}"
    parts = [k for k in row if k.endswith(" alone s")]
    alone = ", ".join(f"{k[: -len(' alone s')]} alone {_ms(row[k])}" for k in parts)
    return (
        f"{label}: {alone}, both {_ms(row['both s'])} (sum {_ms(row['sum of parts s'])}"
        f", larger {_ms(row['larger part s'])}): overlap share "
        f"{row['overlap share']:.2f} [measured ({where})]"
    )


def _link_part(run: Run, slices: bool, smoke: bool, json_path: Path) -> dict:
    """The link probes in a process of their own; their programs saved beside
    `json_path` and named from its folder."""
    programs = programs_folder(json_path)
    args = {**(LINK_SMOKE if smoke else LINK), "slices": slices}
    args["programs"] = str(programs)
    env = None
    if slices:  # the on-device compile's thunks (a GPU's), in XLA's dump
        import os

        dump = f"--xla_dump_to={programs / 'xla-dump-probes'}"
        flags = f"{os.environ.get('XLA_FLAGS', '')} {dump}"
        env = {"XLA_FLAGS": f"{flags} --xla_dump_hlo_module_re=.*probe.*".strip()}
    part = run(["link", json.dumps(args)], 240, env)
    out = {"seconds": part.get("seconds"), **part.get("result", part)}
    for row in out.values():
        if isinstance(row, dict) and "programs" in row:
            row["programs"] = [relative(p, json_path) for p in row["programs"]]
    return out


def _print_link(probes: dict[str, Any]) -> None:
    where = probes.get("device", "?")
    if "error" in probes:
        print(f"link probes failed: {probes['error']}", flush=True)
        return
    for key in ("host -> device GB/s", "device -> host GB/s", "both ways GB/s"):
        print(
            f"{key.replace(' GB/s', '')}: {probes[key]:.2f} GB/s [measured ({where})]",
            flush=True,
        )
    mm = probes["matmul"]
    print(
        f"bf16 matmul ({mm['dim']}^2, chain of {mm['matmuls']}): "
        f"{mm['bf16 flop/s'] / 1e12:.3g} TFLOP/s [measured ({where})]",
        flush=True,
    )
    for key, row in probes.items():
        if key.startswith("("):
            print(describe(key, row, where), flush=True)


def calibrate(
    run: Run, *, smoke: bool, json_path: Path, host_size: Any, versions: dict
) -> dict[str, Any]:
    """`gpu_check.py --calibrate`: the link probes and the host update, each in a
    process of its own; the calibration file's object, written to `json_path`
    (its fields not measured listed under `"missing"` in `details`)."""
    probes = _link_part(run, False, smoke, json_path)
    _print_link(probes)
    part = run(["host update", json.dumps(host_size), "3"], 240)
    host = {"seconds": part.get("seconds"), **part.get("result", part)}
    rate = host_rate(host)
    where = probes.get("device", "?")
    print(
        f"host update's memory rate: "
        f"{'-' if rate is None else f'{rate / 1e9:.2f} GB/s'} [measured ({where})]",
        flush=True,
    )
    result = calibration(probes, host, probes.get("backend", "?"), versions)
    result["details"]["missing"] = missing(result)
    return result


def _before(size_name: str) -> dict[str, float]:
    """The step times measured before (`BEFORE`), by configuration."""
    if not BEFORE.exists():
        return {}
    runs = json.loads(BEFORE.read_text()).get("runs", [])
    return {
        r["config"]: r["step s median"]
        for r in runs
        if r.get("size") == size_name and r.get("step s median")
    }


def overlap(
    run: Run,
    *,
    smoke: bool,
    json_path: Path,
    step_size: tuple[str, Any],
    profile_size: tuple[str, Any],
    configs: list[str],
    flag_env: Callable[[str], dict[str, str]],
    budget: float,
) -> dict[str, Any]:
    """`gpu_check.py --overlap`: the probes (a)-(d); the step of `step_size` under
    each of `configs` (the first the reference whose parameters after two steps
    the others' are checked against), beside the times measured before; one step
    of `configs[0]` at `profile_size` profiled. Each part in a process of its own;
    one that fails, or would start past `budget` seconds, recorded as such."""
    import os
    import tempfile

    start = time.perf_counter()
    programs = programs_folder(json_path)
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    print(
        f"CUDA_DEVICE_MAX_CONNECTIONS={connections} (unset: CUDA's default, 8)",
        flush=True,
    )
    out: dict[str, Any] = {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    out["probes"] = probes = _link_part(run, True, smoke, json_path)
    _print_link(probes)
    link = {
        "pinned host -> device GB/s": probes.get("host -> device GB/s"),
        "device -> pinned host GB/s": probes.get("device -> host GB/s"),
    }
    name, size = step_size
    before = _before(name)
    out["steps"] = steps = []
    with tempfile.TemporaryDirectory() as scratch:
        reference = str(Path(scratch) / "reference.npz")
        for i, config in enumerate(configs):
            row: dict[str, Any] = {"size": name, "config": config}
            if time.perf_counter() - start > budget:
                row["error"] = f"skipped: past the {budget:.0f} s budget"
            else:
                program = programs / f"overlap-{slug(name)}-{slug(config)}.hlo.gz"
                check = {"save" if i == 0 else "against": reference}
                argv = ["measure", config, json.dumps(size), json.dumps(link)]
                argv += [str(program), json.dumps(check)]
                part = run(argv, 300, flag_env(config))
                row.update({"seconds": part.get("seconds")})
                row.update(part.get("result", {"error": part.get("error")}))
                if row.get("program"):
                    row["program"] = relative(row["program"], json_path)
            # (or the nearest configuration measured: prefetching was, at limit 16)
            for known in (config, f"{config}, async limit 16"):
                if known in before and "before s" not in row:
                    row["before s"], row["before config"] = before[known], known
            steps.append(row)
            print(_step_line(row, probes.get("device", "?")), flush=True)
    name, size = profile_size
    if time.perf_counter() - start > budget:
        out["profile"] = {"error": f"skipped: past the {budget:.0f} s budget"}
    else:
        folder = programs / f"profile-{slug(name)}-{slug(configs[0])}"
        argv = ["profile", configs[0], json.dumps(size), str(folder)]
        part = run(argv, 300, flag_env(configs[0]))
        out["profile"] = {
            "size": name,
            "config": configs[0],
            "seconds": part.get("seconds"),
            **part.get("result", {"error": part.get("error")}),
        }
    print(_profile_line(out["profile"], probes.get("device", "?")), flush=True)
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _step_line(row: dict[str, Any], where: str) -> str:
    head = f"{row['size']} step, {row['config']}"
    if "step s median" not in row:
        return f"{head}: {row.get('error')}"
    text = f"{head}: {_ms(row['step s median'])} [measured ({where})]"
    if row.get("before s"):
        text += f", before {_ms(row['before s'])} [measured (H200, {BEFORE.name}"
        text += f", {row['before config']})]"
    check = row.get("parameters after 2 steps", {})
    if "against" in check:
        diff = check["max |params - reference|"]
        text += f"; parameters after 2 steps: max |diff| {diff:.3g}"
        text += f", equal {check['equal']}, close {check['close (1e-6)']}"
    elif "saved" in check:
        text += "; parameters after 2 steps: the reference"
    return text


def _profile_line(row: dict[str, Any], where: str) -> str:
    head = f"profiled {row.get('size')} step, {row.get('config')}"
    if "step s median (not profiled)" not in row:
        return f"{head}: {row.get('error')}"
    text = f"{head}: {_ms(row['step s median (not profiled)'])} unprofiled"
    shares = ("copy time overlapping kernels", "H2D time overlapping D2H")
    if all(row.get(k) is not None for k in shares):
        text += "; " + ", ".join(f"{k} {row[k]:.2f}" for k in shares)
    else:
        text += f"; {row.get('note') or row.get('error')}"
    return f"{text} [measured ({where})]"
