"""Where each residual of a `jax.vjp` jaxpr comes from (`_residuals.py` reads them).

An adapter: it walks back through the jaxpr from each residual output to the
equation or input that made it.
"""

from typing import Any, NamedTuple

from jax.sharding import AxisType

from . import _jaxpr


class Origin(NamedTuple):
    """Where one residual comes from."""

    aval: Any  # its abstract value, as the vjp's output
    source: str  # "argument", "constant", "literal", "named", "carry" or a primitive
    name: str | None  # the checkpoint name, when `source == "named"`
    per_iteration: bool  # stacked over a scan's iterations (one per layer)
    source_infos: tuple  # of the equation that computed it and the calls around it


def residual_origins(closed: Any, num_res: int) -> list[Origin]:
    """The origin of each of the last `num_res` outputs of `closed` (the
    residuals of `jax.make_jaxpr` of `jax.vjp`). Looks through `jit` calls,
    `reduce_precision`, a cast onto `Auto` axes, the `device_put` that offloads a
    named value, and into the body of a scan whose per-iteration output (one slice
    per layer) it is."""
    jaxpr = closed.jaxpr
    producers: dict[int, dict] = {}  # per jaxpr, the equation producing each var
    outvars = jaxpr.outvars[len(jaxpr.outvars) - num_res :]
    return [
        _WalkBack(v, jaxpr, producers).find()._replace(aval=v.aval) for v in outvars
    ]


class _WalkBack:
    """A walk back from a value to the equation or input it comes from."""

    def __init__(self, v: Any, jaxpr: Any, producers: dict[int, dict]):
        self.v = v
        self.jaxpr = jaxpr
        self.producers = producers
        self.enclosing: list[tuple[Any, Any]] = []  # (outer jaxpr, jit or scan)
        self.per_iteration = False  # inside a scan, for its stacked output

    def find(self) -> Origin:
        """The origin, one step back at a time."""
        while not _jaxpr.is_literal(self.v):
            eqn = self._producer(self.v)
            found = self._out_of_call() if eqn is None else self._through(eqn)
            if found is not None:
                return found
        return self._found("literal")

    def _producer(self, v: Any) -> Any:
        """The equation of the current jaxpr that computes `v`, or None."""
        key = id(self.jaxpr)
        if key not in self.producers:
            self.producers[key] = {o: e for e in self.jaxpr.eqns for o in e.outvars}
        return self.producers[key].get(v)

    def _out_of_call(self) -> Origin | None:
        """`v` is an input of the jaxpr: on to the operand of the call around it."""
        invars = self.jaxpr.invars
        if not (self.enclosing and self.v in invars):
            return self._found("argument" if self.v in invars else "constant")
        outer, call = self.enclosing.pop()
        position = invars.index(self.v)
        if _jaxpr.is_scan(call):
            scan = _jaxpr.scan_layout(call)
            if scan.consts <= position < scan.consts + scan.carry:
                # The carry entering an iteration (a layer's input), saved.
                names = [
                    _jaxpr.checkpoint_name_of(e)
                    for e in self.jaxpr.eqns
                    if _jaxpr.is_checkpoint_name(e) and e.invars[0] is self.v
                ]
                return self._found("named", names[0]) if names else self._found("carry")
        self.v, self.jaxpr = call.invars[position], outer
        return None

    def _through(self, eqn: Any) -> Origin | None:
        """On through `eqn`, which computes `v`, where it only passes a value on."""
        index = eqn.outvars.index(self.v)
        body = _jaxpr.jit_body(eqn)
        # A `reshard` onto a mesh of `Auto` axes only (the way into
        # `jax.sharding.auto_axes`, `Policy(loss_axes="auto")`) keeps the buffer, in
        # the layout it had (JAX emits no sharding constraint for it).
        to_auto = _jaxpr.is_reshard(eqn) and all(
            t == AxisType.Auto for t in _jaxpr.reshard_destination(eqn).mesh.axis_types
        )
        if _jaxpr.is_reduce_precision(eqn) or to_auto:
            self.v = eqn.invars[0]
            return None
        if body is None and _jaxpr.is_scan(eqn):
            if index < _jaxpr.scan_layout(eqn).carry:
                return self._computed(eqn, index)
            self.per_iteration = True
            body = _jaxpr.scan_layout(eqn).body
        elif body is None:
            return self._computed(eqn, index)
        self.enclosing.append((self.jaxpr, eqn))
        self.jaxpr, self.v = body, body.outvars[index]
        return None

    def _computed(self, eqn: Any, index: int) -> Origin:
        """`v` computed by `eqn`: a named value (perhaps offloaded), or the user's."""
        # The offload of a named value?
        named = self._producer(eqn.invars[index]) if _jaxpr.is_device_put(eqn) else eqn
        if named is not None and _jaxpr.is_checkpoint_name(named):
            return self._found("named", _jaxpr.checkpoint_name_of(named))
        # An equation inside a `jit` keeps only the frames below that call: the
        # calls around it have the rest.
        calls = [eqn] + [call for _, call in reversed(self.enclosing)]
        infos = tuple(e.source_info for e in calls)
        return self._found(_jaxpr.primitive_name(eqn), infos=infos)

    def _found(self, source: str, name: str | None = None, infos: tuple = ()) -> Origin:
        return Origin(self.v.aval, source, name, self.per_iteration, infos)
