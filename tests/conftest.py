import os


# Before JAX is imported: several CPU devices so that shardings are exercised, and no
# probing for TPU hardware when libtpu is installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
