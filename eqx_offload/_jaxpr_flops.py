"""Counting a traced program's matmul FLOPs, for model FLOPs utilisation
(`StepTime.mfu`): what a model computes, whatever the compiler makes of it.

Each `dot_general` counts 2 × its output's elements × its contracted size (with its
batch dimensions: 2 × batch × M × N × K). Each `conv_general_dilated` counts 2 × its
output's elements × one output's kernel (its input features per group times its
window). Nothing else counts: elementwise work, reductions, gathers, and any kernel
the program calls as an opaque custom call (a fused attention kernel) are not
matmul FLOPs here. The parameters read (`dimension_numbers`) are as in jax 0.10.2;
`tests/test_mfu.py` pins them.
"""

import math
from typing import Any

import jax.extend.core as jex
import jax.extend.core.primitives as _p

from . import _jaxpr


def matmul_flops(closed_jaxpr: Any) -> float:
    """The matmul FLOPs of a (closed) jaxpr, nested jaxprs included.

    - A `scan` counts its body `length` times.
    - A `while` loop counts its body (and its condition) once: its trip count is not
        known from the jaxpr.
    - A `cond` counts its largest branch.
    - Any other equation with jaxprs in its parameters counts each once. A call
        (`jax.jit`, `closed_call`), a `jax.checkpoint` (its forward only: the
        backward's recomputation is not traced here), a `custom_jvp`/`custom_vjp`
        function (its primal function: the rules are not jaxprs).
    - A `shard_map` body counts one shard's FLOPs.
    """
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    return sum((_flops(eqn) for eqn in jaxpr.eqns), 0.0)


def _flops(eqn: Any) -> float:
    """The matmul FLOPs of one equation, with the jaxprs it runs."""
    out = math.prod(eqn.outvars[0].aval.shape) if eqn.outvars else 0
    if eqn.primitive is _p.dot_general_p:
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(lhs[d] for d in contracting)
    if eqn.primitive is _p.conv_general_dilated_p:
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out * (math.prod(rhs) // out_features)
    if _jaxpr.is_scan(eqn):
        layout = _jaxpr.scan_layout(eqn)
        return layout.length * matmul_flops(layout.body)
    if _jaxpr.is_cond(eqn):
        return max(matmul_flops(b) for b in _jaxpr.cond_branches(eqn))
    return sum((matmul_flops(sub) for sub in jex.jaxprs_in_params(eqn.params)), 0.0)
