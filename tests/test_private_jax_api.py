"""The private parts of JAX and Equinox in `_compat.py` still work as they did
when checked (jax and equinox versions named there): each test fails, instead of
a fallback hiding the change, when an upgrade breaks one."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from eqx_offload import _compat, _loading


def _restored_like() -> jax.Array:
    """A host-resident array whose type says device memory, as orbax restores it."""
    sharding = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), sharding)
    out = jax.make_array_from_single_device_arrays(
        x.shape, sharding, [x.addressable_data(0)]
    )
    assert jax.typeof(out).memory_space == jax.memory.Space.Device  # the JAX quirk
    return out


def test_host_arrays_are_retyped_without_a_copy():
    x = _restored_like()
    out = _compat.retype_in_host_memory(x)
    assert jax.typeof(out).memory_space == jax.memory.Space.Host
    assert out.sharding == x.sharding
    pointer = out.addressable_data(0).unsafe_buffer_pointer()
    assert pointer == x.addressable_data(0).unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(out), np.arange(6.0).reshape(2, 3))


def test_load_takes_the_fast_path():
    x = _restored_like()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copying fallback warns
        out = _loading._host_aval(x)
    assert jax.typeof(out).memory_space == jax.memory.Space.Host
    pointer = out.addressable_data(0).unsafe_buffer_pointer()
    assert pointer == x.addressable_data(0).unsafe_buffer_pointer()


def f(x, y):
    return x + y


@pytest.mark.parametrize(
    "donate, donated",
    [("all", (0, 1)), ("all-except-first", (1,)), ("none", ())],
)
def test_filter_jit_parts(donate, donated):
    parts = _compat.filter_jit_parts(eqx.filter_jit(f, donate=donate))
    assert parts == _compat.FilterJit(f, donated)
    nested = _compat.filter_jit_parts(eqx.filter_jit(eqx.filter_jit(f)))
    assert nested is not None and _compat.filter_jit_parts(nested.fun) is not None


def test_filter_jit_parts_of_other_functions():
    assert _compat.filter_jit_parts(f) is None
    assert _compat.filter_jit_parts(jax.jit(f)) is None


def test_checked_against_this_equinox():
    assert _compat.EQUINOX_VERSION == eqx.__version__, (
        f"equinox {eqx.__version__} is installed; `_compat.py` was checked against "
        f"{_compat.EQUINOX_VERSION}: check `filter_jit_parts`, then update it."
    )
