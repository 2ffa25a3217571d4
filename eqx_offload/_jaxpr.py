"""Reading jaxprs: how JAX lays out its equations, and which primitive is which.

This is the one place that knows the parameters and operands of JAX's equations.
Checked against jax 0.10.2, and the scan's layout also against jax 0.11.2.
`tests/test_jaxpr_adapter.py` pins every layout read here, so a JAX upgrade that changes
one fails there first. Every other module that walks a jaxpr asks this one. It
says which primitive an equation is, by the primitive objects JAX exports where
it exports one. It says which sub-jaxprs run on which operands. And it reads the
few parameters the library needs.
"""

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as _p


# Call-like primitives whose body runs on all of the equation's operands.
_CALLS = (_p.jit_p, _p.closed_call_p, _p.custom_jvp_call_p, _p.custom_vjp_call_p)


def _primitive(x: Any) -> Any:
    """The primitive of an equation (anything with `.primitive`), or `x` itself."""
    return getattr(x, "primitive", x)


def _is(primitive: Any) -> Callable[[Any], bool]:
    """Whether an equation (or a primitive) is `primitive`."""
    return lambda x: _primitive(x) is primitive


def _named(name: str) -> Callable[[Any], bool]:
    """Whether an equation (or a primitive) is the one JAX 0.10.2 calls `name`:
    for the primitives it does not export, the only names matched here."""
    return lambda x: _primitive(x).name == name


# --- Which primitive: each takes an equation or a primitive --------------------

is_scan = _is(_p.scan_p)
is_cond = _is(_p.cond_p)
is_while = _is(_p.while_p)
is_jit = _is(_p.jit_p)
is_checkpoint_name = _is(_p.name_p)  # `jax.ad_checkpoint.checkpoint_name`
is_device_put = _is(_p.device_put_p)
is_dynamic_slice = _is(_p.dynamic_slice_p)
is_squeeze = _is(_p.squeeze_p)
is_optimization_barrier = _is(jax.lax.optimization_barrier_p)
is_reduce_precision = _is(_p.reduce_precision_p)
is_custom_vmap = _named("custom_vmap_call")  # `jax.custom_batching.custom_vmap`
is_platform_index = _named("platform_index")  # `jax.lax.platform_dependent`'s
is_reshard = _named("reshard")  # `jax.sharding.reshard`, `jax.sharding.auto_axes`


# Operations whose result is (a piece, a view or a cast of) their first operand.
_KEEPS_FIRST = {
    getattr(_p, f"{name}_p")
    for name in """dynamic_slice dynamic_update_slice slice squeeze reshape
    broadcast_in_dim copy convert_element_type""".split()
}


def keeps_first_operand(x: Any) -> bool:
    """Whether the result is (a piece, a view or a cast of) the first operand."""
    return _primitive(x) in _KEEPS_FIRST


def primitive_name(x: Any) -> str:
    """The primitive's name, for messages and reports (never to identify one)."""
    return _primitive(x).name


def is_literal(v: Any) -> bool:
    """Whether an operand is a constant written into the jaxpr, not a variable."""
    return isinstance(v, jex.Literal)


# --- Walking --------------------------------------------------------------------


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr, nested jaxprs included: each equation
    before the equations of the jaxprs in its parameters."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from equations(sub)


class SubJaxpr(NamedTuple):
    """A jaxpr an equation runs, and which of the equation's operands feed it."""

    jaxpr: Any  # a `jax.extend.core.Jaxpr`
    operands: dict[int, int]  # operand index -> input index of `jaxpr`
    sliced: bool  # the operands are sliced per iteration (a scan's `xs`)


class ScanLayout(NamedTuple):
    """A scan's operands are `consts + carry + xs`.

    Its body's inputs are the same, with one slice of each `xs`. The body's
    outputs are `carry + ys`. The scan's are `carry + ys`, stacked over `length`
    iterations.
    """

    body: Any  # the body `jax.extend.core.Jaxpr`
    consts: int
    carry: int
    xs: int
    length: int


def scan_layout(eqn: Any) -> ScanLayout:
    params = eqn.params
    if "num_consts" in params:  # jax 0.10
        consts, carry = params["num_consts"], params["num_carry"]
    else:
        # jax 0.11 groups the operands in a tree, `ft_in`: (consts, carry, xs).
        consts, carry, _ = (len(group) for group in params["ft_in"].unpack())
    xs = len(eqn.invars) - consts - carry
    return ScanLayout(params["jaxpr"].jaxpr, consts, carry, xs, int(params["length"]))


def cond_branches(eqn: Any) -> tuple[Any, ...]:
    """The branches (`jax.extend.core.ClosedJaxpr`s) of a `cond`, whose first
    operand is the branch index and the rest the branches' inputs."""
    return tuple(eqn.params["branches"])


def cond_platforms(eqn: Any) -> tuple | None:
    """For a `cond` made by `jax.lax.platform_dependent`, the platforms of each
    branch (a tuple of names, or `None` for the default); else `None`."""
    return eqn.params.get("branches_platforms") or None


def platform_index_platforms(eqn: Any) -> tuple:
    """The platforms of each branch a `platform_index` chooses from (as
    `cond_platforms`)."""
    return tuple(eqn.params.get("platforms", ()))


def sub_jaxprs(eqn: Any) -> list[SubJaxpr] | None:
    """How a higher-order equation passes its operands on: each sub-jaxpr it runs,
    with the operands that feed its inputs. `None` for an equation that computes on
    its operands (or whose sub-jaxprs' inputs are not known here)."""
    n = len(eqn.invars)
    if is_scan(eqn):
        scan = scan_layout(eqn)
        first_x = scan.consts + scan.carry
        return [
            SubJaxpr(scan.body, {i: i for i in range(first_x)}, False),
            SubJaxpr(scan.body, {i: i for i in range(first_x, n)}, True),
        ]
    if is_cond(eqn):
        inputs = {i: i - 1 for i in range(1, n)}
        return [SubJaxpr(b.jaxpr, inputs, False) for b in cond_branches(eqn)]
    if is_while(eqn):
        # The operands are `cond_consts + body_consts + carry`; the cond's inputs
        # `cond_consts + carry`, the body's `body_consts + carry`.
        params = eqn.params
        cond_consts, body_consts = params["cond_nconsts"], params["body_nconsts"]
        cond = {i: i for i in range(cond_consts)}
        body = {cond_consts + i: i for i in range(body_consts)}
        for k, i in enumerate(range(cond_consts + body_consts, n)):
            cond[i] = cond_consts + k
            body[i] = body_consts + k
        return [
            SubJaxpr(params[name].jaxpr, inputs, False)
            for name, inputs in (("cond_jaxpr", cond), ("body_jaxpr", body))
        ]
    subs = list(jex.jaxprs_in_params(eqn.params))
    if len(subs) == 1 and len(subs[0].invars) == n:  # jit, checkpoint, custom_jvp...
        return [SubJaxpr(subs[0], {i: i for i in range(n)}, False)]
    return None


def call_body(eqn: Any) -> Any:
    """The `jax.extend.core.ClosedJaxpr` a call (`jax.jit`, `closed_call`,
    `custom_jvp`/`custom_vjp` functions) runs on all its operands; `None` for
    other equations."""
    if _primitive(eqn) not in _CALLS:
        return None
    bodies = [v for v in eqn.params.values() if isinstance(v, jex.ClosedJaxpr)]
    return next((b for b in bodies if len(b.jaxpr.invars) == len(eqn.invars)), None)


def jit_body(eqn: Any) -> Any:
    """The `jax.extend.core.Jaxpr` an inner `jax.jit` runs; `None` for other
    equations."""
    return eqn.params["jaxpr"].jaxpr if is_jit(eqn) else None


# --- Parameters -----------------------------------------------------------------


def checkpoint_name_of(eqn: Any) -> str:
    """The name of a `checkpoint_name` equation."""
    return eqn.params["name"]


def checkpoint_policy_of(eqn: Any) -> Any:
    """The policy of a `jax.checkpoint` equation (`None` if it has none or it is
    another equation)."""
    return eqn.params.get("policy") if _primitive(eqn) is _p.remat_p else None


def device_put_destinations(eqn: Any) -> tuple:
    """Where a `device_put` moves each of its operands: a `jax.memory.Space`, a
    device or sharding, or `None`."""
    return tuple(eqn.params["devices"])


def reshard_destination(eqn: Any) -> Any:
    """The sharding a `reshard` casts its operand onto."""
    return eqn.params["dst_sharding"]


def reduction_axes(eqn: Any) -> tuple[int, ...]:
    """The axes a `reduce_sum`/`reduce_max`/... reduces (works on any object with
    the equation's `params`)."""
    return tuple(eqn.params["axes"])


def broadcast_dimensions(eqn: Any) -> tuple[int, ...]:
    """Where a `broadcast_in_dim` puts its operand's axes in its output."""
    return tuple(eqn.params["broadcast_dimensions"])


def source_function(eqn: Any, package: str) -> str | None:
    """Where in `package` (a top-level module name: `"optax"`) the code that made
    `eqn` is, from the equation's traceback: `"update_fn (optax/_src/linesearch.py,
    line 1203)"` for the innermost such frame; `None` if no code of it did."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    marker = f"/{package}/"
    for frame in getattr(traceback, "frames", ()) or ():
        path = frame.file_name.replace("\\", "/")
        if marker in path:
            short = package + "/" + path.rsplit(marker, 1)[1]
            return f"{frame.function_name} ({short}, line {frame.line_num})"
    return None


def has_effects(eqn: Any) -> bool:
    """Whether an equation has side effects (a callback, an ordered I/O)."""
    return bool(eqn.effects)


# --- Tracing and evaluating ------------------------------------------------------


def evaluate(closed: Any, *args: Any) -> list:
    """The outputs of `closed` (a closed jaxpr) on `args`."""
    return jex.jaxpr_as_fun(closed)(*args)


def closure_converted(fn: Any, *examples: Any) -> tuple[Any, list[Any]]:
    """`fn` traced once at the types of `examples`, with its closed-over values.

    The function returned takes every value `fn` closes over as trailing
    arguments. Those values are arrays and tracers of the traces around. Unlike
    `jax.closure_convert`, every closed-over value is hoisted, differentiated or
    not. And nothing is cached across traces: `jax.closure_convert` caches by
    function and types, and handed an earlier trace's tracer to a later one.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*examples)
    out_tree = jax.tree.structure(shapes)
    jaxpr = closed.jaxpr

    def converted(*args: Any) -> Any:
        n = len(args) - len(closed.consts)
        flat = jax.tree.leaves(args[:n])
        run = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, list(args[n:])))
        return jax.tree.unflatten(out_tree, run(*flat))

    return converted, list(closed.consts)
