"""The jaxpr adapter (`eqx_offload/_jaxpr.py`) against the jaxprs JAX traces: every
layout it reads, on small programs. A JAX upgrade that changes one fails here."""

import jax
import jax.extend.core.primitives as primitives
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from eqx_offload import _jaxpr


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(part) for part in v.split(".")[:3] if part.isdigit())


def _only(closed, predicate):
    found = [e for e in _jaxpr.equations(closed) if predicate(e)]
    assert len(found) == 1, [str(e.primitive) for e in _jaxpr.equations(closed)]
    return found[0]


def test_checked_against_this_jax():
    # The adapter says which JAX it was checked against; a newer one must be checked
    # again (run this file) before the version in `_jaxpr.py` and here is raised.
    assert "jax 0.10.2" in (_jaxpr.__doc__ or "")
    assert _version(jax.__version__) <= (0, 10, 2)


def test_scan():
    w = jnp.ones((3,))

    def f(c1, c2, xs):
        def body(carry, x):
            a, b = carry
            return (a + x * w, b * 2), a.sum()

        return jax.lax.scan(body, (c1, c2), xs)

    closed = jax.make_jaxpr(f)(jnp.zeros(3), jnp.zeros(()), jnp.ones((5, 3)))
    eqn = _only(closed, _jaxpr.is_scan)
    scan = _jaxpr.scan_layout(eqn)
    assert (scan.consts, scan.carry, scan.xs, scan.length) == (1, 2, 1, 5)
    assert len(scan.body.invars) == len(eqn.invars) == 4
    assert len(scan.body.outvars) == len(eqn.outvars) == 3
    subs = _jaxpr.sub_jaxprs(eqn)
    assert subs is not None
    (whole, sliced) = subs
    assert whole.jaxpr is sliced.jaxpr is scan.body
    assert (whole.operands, whole.sliced) == ({0: 0, 1: 1, 2: 2}, False)
    assert (sliced.operands, sliced.sliced) == ({3: 3}, True)
    # The const is `w`, the xs a (3,) slice of each (5, 3) operand.
    assert eqn.invars[0].aval.shape == (3,)
    assert scan.body.invars[3].aval.shape == (3,)
    assert eqn.invars[3].aval.shape == (5, 3)


def test_cond():
    w = jnp.ones(())

    def f(i, x, y):
        return jax.lax.cond(i > 0, lambda a, b: a * w + b, lambda a, b: a - b, x, y)

    closed = jax.make_jaxpr(f)(1, jnp.ones(()), jnp.ones(()))
    eqn = _only(closed, _jaxpr.is_cond)
    branches = _jaxpr.cond_branches(eqn)
    assert len(branches) == 2
    assert _jaxpr.cond_platforms(eqn) is None
    n = len(eqn.invars)  # the index, then the branches' inputs (consts included)
    assert all(len(b.jaxpr.invars) == n - 1 for b in branches)
    subs = _jaxpr.sub_jaxprs(eqn)
    assert subs is not None and len(subs) == 2
    for sub, branch in zip(subs, branches):
        assert sub.jaxpr is branch.jaxpr
        assert sub.operands == {i: i - 1 for i in range(1, n)}
        assert not sub.sliced


def test_platform_dependent():
    def f(x):
        return jax.lax.platform_dependent(x, cpu=jnp.cos, default=jnp.sin)

    closed = jax.make_jaxpr(f)(1.0)
    index = _only(closed, _jaxpr.is_platform_index)
    assert _jaxpr.platform_index_platforms(index) == (("cpu",), None)
    eqn = _only(closed, _jaxpr.is_cond)
    assert _jaxpr.cond_platforms(eqn) == (("cpu",), None)
    assert eqn.invars[0] is index.outvars[0]


def test_while():
    limit, step = jnp.array(3), jnp.array(2.0)

    def f(x):
        return jax.lax.while_loop(
            lambda s: s[0] < limit, lambda s: (s[0] + 1, s[1] * step), (0, x)
        )

    closed = jax.make_jaxpr(f)(jnp.ones(()))
    eqn = _only(closed, _jaxpr.is_while)
    subs = _jaxpr.sub_jaxprs(eqn)
    assert subs is not None
    cond, body = subs
    assert len(eqn.invars) == 4  # one const each, then the carry
    assert len(cond.jaxpr.invars) == len(body.jaxpr.invars) == 3
    assert cond.jaxpr.invars[0].aval.dtype == jnp.int32  # `limit`
    assert body.jaxpr.invars[0].aval.dtype == jnp.float32  # `step`
    assert len(cond.jaxpr.outvars) == 1 and len(body.jaxpr.outvars) == 2
    assert cond.operands == {0: 0, 2: 1, 3: 2}
    assert body.operands == {1: 0, 2: 1, 3: 2}


def test_jit():
    closed = jax.make_jaxpr(lambda x, y: jax.jit(jnp.add)(x, y) * 2)(1.0, 2.0)
    eqn = _only(closed, _jaxpr.is_jit)
    body = _jaxpr.jit_body(eqn)
    assert body is not None and len(body.invars) == 2
    call = _jaxpr.call_body(eqn)
    assert call is not None and call.jaxpr is body
    assert _jaxpr.sub_jaxprs(eqn) == [_jaxpr.SubJaxpr(body, {0: 0, 1: 1}, False)]
    mul = _only(closed, lambda e: e.primitive is primitives.mul_p)
    assert _jaxpr.jit_body(mul) is None and _jaxpr.call_body(mul) is None
    assert _jaxpr.sub_jaxprs(mul) is None
    assert _jaxpr.is_literal(mul.invars[1]) and not _jaxpr.is_literal(mul.invars[0])


def test_custom_jvp_is_a_call():
    f = jax.custom_jvp(jnp.sin)
    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    closed = jax.make_jaxpr(f)(1.0)
    (eqn,) = closed.jaxpr.eqns
    call = _jaxpr.call_body(eqn)
    assert call is not None and len(call.jaxpr.invars) == 1
    assert _jaxpr.jit_body(eqn) is None


def test_checkpoint_and_names():
    policy = jax.checkpoint_policies.save_only_these_names("inner")

    def layer(x):
        return jnp.sin(checkpoint_name(x * 2, "inner"))

    def f(x):
        y = jax.jit(jax.checkpoint(layer, policy=policy))(x)
        return checkpoint_name(y, "outer")

    closed = jax.make_jaxpr(f)(1.0)
    eqn = _only(closed, lambda e: _jaxpr.checkpoint_policy_of(e) is not None)
    assert _jaxpr.checkpoint_policy_of(eqn) is policy
    subs = _jaxpr.sub_jaxprs(eqn)
    assert subs is not None and subs[0].operands == {0: 0}
    names = [
        _jaxpr.checkpoint_name_of(e)
        for e in _jaxpr.equations(closed)
        if _jaxpr.is_checkpoint_name(e)
    ]
    assert names == ["inner", "outer"]  # nested first: the `jit` comes first
    assert _jaxpr.is_checkpoint_name(primitives.name_p)
    assert not _jaxpr.is_checkpoint_name(primitives.sin_p)


def test_device_put():
    def f(x, y):
        return jax.device_put((x, y), (jax.memory.Space.Host, jax.memory.Space.Device))

    closed = jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(3))
    eqn = _only(closed, _jaxpr.is_device_put)
    destinations = _jaxpr.device_put_destinations(eqn)
    assert destinations == (jax.memory.Space.Host, jax.memory.Space.Device)
    assert closed.out_avals[0].memory_space == jax.memory.Space.Host


def test_reshard_onto_auto_axes():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        a = jax.device_put(jnp.ones(8), PartitionSpec("x"))
        on_auto = jax.sharding.auto_axes(lambda b: b * 2, out_sharding=PartitionSpec())
        closed = jax.make_jaxpr(on_auto)(a)
    first = next(e for e in _jaxpr.equations(closed) if _jaxpr.is_reshard(e))
    mesh_types = _jaxpr.reshard_destination(first).mesh.axis_types
    assert mesh_types == (AxisType.Auto,)


def test_reduction_and_broadcast_parameters():
    closed = jax.make_jaxpr(lambda x: x.sum(axis=(0, 2))[None, :, None])(
        jnp.ones((2, 3, 4))
    )
    total = _only(closed, lambda e: e.primitive is primitives.reduce_sum_p)
    assert _jaxpr.reduction_axes(total) == (0, 2)
    broadcast = _only(closed, lambda e: e.primitive is primitives.broadcast_in_dim_p)
    assert _jaxpr.broadcast_dimensions(broadcast) == (1,)


@pytest.mark.parametrize(
    "predicate, primitive",
    [
        (_jaxpr.is_scan, primitives.scan_p),
        (_jaxpr.is_cond, primitives.cond_p),
        (_jaxpr.is_while, primitives.while_p),
        (_jaxpr.is_jit, primitives.jit_p),
        (_jaxpr.is_device_put, primitives.device_put_p),
        (_jaxpr.is_reduce_precision, primitives.reduce_precision_p),
        (_jaxpr.is_optimization_barrier, jax.lax.optimization_barrier_p),
    ],
)
def test_identities(predicate, primitive):
    assert predicate(primitive)
    assert not predicate(primitives.add_p)


def test_which_operations_keep_their_first_operand():
    def f(x):
        y = jax.lax.dynamic_slice_in_dim(x, 1, 2).reshape(1, 2).astype(jnp.bfloat16)
        return y + 1

    eqns = jax.make_jaxpr(f)(jnp.ones(4)).jaxpr.eqns
    kept = {e.primitive.name: _jaxpr.keeps_first_operand(e) for e in eqns}
    assert kept["dynamic_slice"] and kept["reshape"] and kept["convert_element_type"]
    assert not kept["add"]
