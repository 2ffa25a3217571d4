import atexit
import os
import shutil
import tempfile


# Before JAX is imported: several CPU devices so that shardings are exercised, and no
# probing for TPU hardware when libtpu is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for this run, starting empty, so that a program compiled by
# one test (or an example, or a subprocess: they inherit the environment) is read
# back by the next one instead of compiled again. Every program is kept, however
# small or quick to compile. A directory given in the environment is used instead
# (and kept).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="eqx_offload_tests_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The CPU programs compiled with LLVM's optimizations off: about a third less time
# compiling, which is most of these tests' time. The memory figures the tests
# compare (the CPU's, and the TPU's from libtpu, which accepts the flag) and the
# numbers they compare to a reference are the same.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_num_cpu_devices", 8)
# Standard dtype promotion: strict promotion breaks optax.adam's update.
jax.config.update("jax_numpy_dtype_promotion", "standard")


@pytest.fixture
def getkey():
    """`getkey()` returns a fresh PRNG key each call."""
    keys = iter(jax.random.split(jax.random.key(5678), 1000))
    return lambda: next(keys)
