import atexit
import gc
import os
import platform
import shutil
import tempfile


# Before JAX is imported: several CPU devices so that shardings are exercised, and no
# probing for TPU hardware when libtpu is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for this run, starting empty, so that a program compiled by
# one test (or a subprocess, or the other pytest-xdist worker: they inherit the
# environment of the process that made it) is read back by the next one instead of
# compiled again. Every program is kept, however small or quick to compile. A
# directory given in the environment is used instead (and kept).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="eqx_offload_tests_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Ten frames of Python traceback in each operation's MLIR location, not JAX's
# default hundred: under pytest a stack is mostly pytest's own frames, and every
# lowering, serialization and compile (the TPU and GPU compilers format them into
# kernel annotations) handled all of them, about a sixth of the suite's time. Every
# test passes unchanged with it (the memory figures they compare, the CPU's and the
# TPU's and GPU's). Dropping tracebacks from locations altogether
# (`jax_include_full_tracebacks_in_locations=False`) changes compiled programs: 14
# tests fail with it. Subprocesses inherit the setting.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "10")
# The CPU compiler's slow parts off: LLVM's optimizations, and XLA's newer fusion
# emitters (with the older elemental emitters a train step compiles in 1.4 s
# instead of 3.8 s). Compiling is most of these tests' time. Every test passes
# unchanged with both flags: the memory figures they compare (the CPU's, the
# README's CPU report among them, and the TPU's from libtpu, which accepts both
# flags) and the numbers they compare to a reference.
_FLAGS = [
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    # One thread per test process for the CPU compiler's code generation and for
    # Eigen's kernels: two processes share CI's two cores, so more threads only
    # contend (the suite took 179 s instead of 202 s here with both).
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_cpu_multi_thread_eigen=false",
]
# Every machine computes what a machine without AVX-512 does: XLA's CPU code for
# AVX2 at most, and oneDNN's matmul kernels (chosen at run time by what the CPU has)
# AVX2's. The instruction set changes float32 results (`tests/numerics.py`); the
# suite's tolerances hold under any, and this makes an AVX-512 machine and an AVX2
# one run the same programs, so a result that differs on another machine differs
# here too. A cap given in the environment is kept (the suite also passes under
# `--xla_cpu_max_isa=SSE4_2` with `ONEDNN_MAX_CPU_ISA=SSE41`: see the README).
if platform.machine().lower() in ("x86_64", "amd64"):
    _FLAGS.append("--xla_cpu_max_isa=AVX2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
for _flag in _FLAGS:
    _flags = os.environ.get("XLA_FLAGS", "")
    if _flag.split("=")[0] not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} {_flag}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from .runtime_typecheck import install  # noqa: E402


# The library runs type-checked (jaxtyping + beartype) in every test: see
# `runtime_typecheck.py`.
install("eqx_offload")


jax.config.update("jax_num_cpu_devices", 8)
# Standard dtype promotion: strict promotion breaks optax.adam's update.
jax.config.update("jax_numpy_dtype_promotion", "standard")

# Python's cycle collector less often: tracing makes many short-lived objects, and
# with the default thresholds (700, 10, 10) enough of them outlive a young
# collection to set off a full one (the whole heap of cached programs, growing all
# run) every few seconds: 7% of a test process's time. With a young generation
# of 10,000 they die young; cyclic garbage is still collected.
gc.set_threshold(10_000, 20, 10)


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key each call."""
    keys = iter(jax.random.split(jax.random.key(5678), 1000))
    return lambda: next(keys)


# The slowest files first (seconds in one of `scripts/test.sh`'s two workers), so
# that the two workers (`-n 2 --dist loadfile --no-loadscope-reorder`), which take
# whole files in this order as they free up, finish together: the
# longest-processing-time-first rule. Every file is listed
# (`test_structure.py` checks): after a change of a file's time, rewrite the list
# from a measured run with `scripts/test_times.py`.
SLOWEST_FIRST = (
    "test_examples.py",  # 32 s
    "test_docs_code_blocks.py",  # 26 s
    "test_plan.py",  # 19 s
    "test_train_step.py",  # 17 s
    "test_gpu_targets.py",  # 16 s
    "test_gpu_check.py",  # 16 s
    "test_prefetch.py",  # 12 s
    "test_step_time.py",  # 12 s
    "test_verify.py",  # 11 s
    "test_accumulation.py",  # 10 s
    "test_filter_offload.py",  # 10 s
    "test_vocab_streaming.py",  # 9 s
    "test_tpu_compile.py",  # 9 s
    "test_saving.py",  # 8 s
    "test_multiprocess.py",  # 8 s
    "test_microbatch.py",  # 8 s
    "test_update_timing.py",  # 8 s
    "test_layout.py",  # 7 s
    "test_streamed_update.py",  # 7 s
    "test_pending_update_outside_the_step.py",  # 7 s
    "test_meshes_train_as_one_device.py",  # 7 s
    "test_tpu_slices.py",  # 7 s
    "test_mistakes.py",  # 7 s
    "test_minimum_traffic.py",  # 6 s
    "test_mixed_precision.py",  # 6 s
    "test_host_update.py",  # 6 s
    "test_memory_report.py",  # 5 s
    "test_metrics.py",  # 4 s
    "test_checkpoint_names.py",  # 4 s
    "test_stacked.py",  # 3 s
    "test_cross_entropy.py",  # 3 s
    "test_mfu.py",  # 3 s
    "test_state_dict.py",  # 3 s
    "test_opt_state_placement.py",  # 3 s
    "test_plan_microbatches.py",  # 3 s
    "test_docs_references.py",  # 2 s
    "test_residual_placement.py",  # 2 s
    "test_structure.py",  # 2 s
    "test_report_traffic.py",  # 2 s
    "test_typechecked.py",  # 2 s
    "test_cli.py",  # 2 s
    "test_host_compute_time.py",  # 1 s
    "test_meshes_by_hand.py",  # 1 s
    "test_calibration.py",  # 1 s
    "test_gpu_copies.py",  # 1 s
    "test_evaluate.py",  # 1 s
    "test_plot.py",  # 1 s
    "test_error_message_style.py",  # 1 s
    "test_docs_benchmark_figures.py",  # 1 s
    "test_annotation_placement.py",  # 0 s
    "test_leaf_paths.py",  # 0 s
    "test_compiler_text.py",  # 0 s
    "test_jaxpr_adapter.py",  # 0 s
    "test_policy.py",  # 0 s
    "test_private_jax_api.py",  # 0 s
    "test_benchmarks_index.py",  # 0 s
    "test_traffic_from_hlo.py",  # 0 s
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
