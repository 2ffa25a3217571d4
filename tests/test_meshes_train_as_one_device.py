"""A transformer-style stack trained on 8 CPU devices over two meshes, 8 (FSDP) and
4×2 (FSDP × a tensor-parallel MLP), with `Auto` and `Explicit` axes, under
`none`, `offload_residuals` and `offload_all`: five SGD steps (with and without
momentum) give the losses and the parameters' updates of a one-device Equinox +
optax run to float32 rounding, every output leaf keeps its
layout and memory kind, the step compiles once per input shape whatever the
specs' spelling, and the streamed optimizer update moves one layer of each
device's shard at a time, never a gathered stack.

The model is laid out in each of the ways in `LAYOUTS`: by hand (`lay_out`, one
`device_put` per leaf) and declared (`Policy(shard=...)`); another way is one more
entry there and a row or two of `CASES`. By hand, the loss keeps `Explicit` axes
(`Policy(loss_axes="explicit")`, which `Net` is written for); declared, it runs
on `Auto` ones (the default).

Last, a model written for one device (an embedding lookup, a cache written with
`.at[].set`) trains on `Explicit` axes as on `Auto` ones."""

import functools
import operator
import re
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

import eqx_offload as eo
from eqx_offload.internal import saved_for_backward

from .helpers import CountCompiles
from .numerics import assert_close, excess, scaled, TRAINED
from .test_state_dict import Net as LM  # embedding, `Stacked` MLPs, head


WIDTH, HIDDEN, DEPTH, OUT, BATCH, STEPS = 16, 32, 3, 4, 8, 5
# DEPTH is no other dimension of any leaf or shard: a leading DEPTH in a compiled
# shape is a stack of layers.
assert DEPTH not in (WIDTH, HIDDEN, OUT, BATCH, WIDTH // 8, HIDDEN // 8)


def _explicit() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and AxisType.Explicit in mesh.axis_types


def _whole(tree: PyTree, keep: tuple[str, ...] = ()) -> PyTree:
    """Under `Explicit` axes, the arrays of `tree` resharded over the mesh axes in
    `keep` only: FSDP computes with whole weights (its gradients go back sharded),
    tensor parallelism keeps its axis. Under `Auto` axes the partitioner decides."""
    if not _explicit():
        return tree

    def gather(x: Array) -> Array:
        spec = tuple(jax.typeof(x).sharding.spec)
        spec += (None,) * (x.ndim - len(spec))
        want = P(*[entry if entry in keep else None for entry in spec])
        return jax.sharding.reshard(x, want)

    return jax.tree.map(gather, tree)


class Block(eqx.Module):
    """Pre-norm residual MLP: `x + fc2(gelu(fc1(norm(x))))`."""

    norm: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.fc1 = eqx.nn.Linear(WIDTH, HIDDEN, key=k1)
        self.fc2 = eqx.nn.Linear(HIDDEN, WIDTH, key=k2)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " width"]:
        norm, fc1, fc2 = _whole((self.norm, self.fc1, self.fc2), keep=("tp",))
        h = jax.nn.gelu(fc1(norm(x)))
        if _explicit():
            # `h` and fc2's input dimension are split over "tp": under `Explicit`
            # axes the sum over it is spelled out.
            return x + jnp.matmul(fc2.weight, h, out_sharding=P(None)) + fc2.bias
        return x + fc2(h)


class Net(eqx.Module):
    blocks: eo.Stacked[Block]
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.blocks = eo.Stacked.from_fn(lambda k: Block(key=k), DEPTH, key=k1)
        self.head = eqx.nn.Linear(WIDTH, OUT, key=k2)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " out"]:
        return _whole(self.head)(self.blocks(x))


class ReferenceNet(eqx.Module):
    """The same model written plainly, for one device: a list of blocks."""

    blocks: list[Block]
    head: eqx.nn.Linear

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " out"]:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(
    model: Net | ReferenceNet, x: Float[Array, "n width"], y: Float[Array, "n out"]
) -> Float[Array, ""]:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def batches(n: int = BATCH) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(n, WIDTH)).astype(np.float32),
            rng.normal(size=(n, OUT)).astype(np.float32),
        )
        for _ in range(STEPS)
    ]


# --- Meshes and layouts ---------------------------------------------------------

# Whole-array specs by attribute path (stacked leaves: the layer axis first, never
# split); array leaves not listed are replicated.
MESHES = {
    "8": (
        (8,),
        ("fsdp",),
        {
            "blocks.layers.norm.weight": P(None, "fsdp"),
            "blocks.layers.norm.bias": P(None, "fsdp"),
            "blocks.layers.fc1.weight": P(None, "fsdp"),
            "blocks.layers.fc1.bias": P(None, "fsdp"),
            "blocks.layers.fc2.weight": P(None, None, "fsdp"),
            "blocks.layers.fc2.bias": P(None, "fsdp"),
            "head.weight": P(None, "fsdp"),
        },
    ),
    # Megatron's MLP: fc1 split by its outputs over "tp", fc2 by its inputs; the
    # other dimension of each, and the rest, FSDP.
    "4x2": (
        (4, 2),
        ("fsdp", "tp"),
        {
            "blocks.layers.norm.weight": P(None, "fsdp"),
            "blocks.layers.norm.bias": P(None, "fsdp"),
            "blocks.layers.fc1.weight": P(None, "tp", "fsdp"),
            "blocks.layers.fc1.bias": P(None, "tp"),
            "blocks.layers.fc2.weight": P(None, "fsdp", "tp"),
            "blocks.layers.fc2.bias": P(None, "fsdp"),
            "head.weight": P(None, "fsdp"),
        },
    ),
}
STREAMED = ("blocks.layers.fc1.weight", "blocks.layers.fc2.weight")  # 3-D stacked


def spelled(spec: P, ndim: int, full: bool) -> P:
    """`spec` with a `None` for every dimension (`full`), or without trailing ones."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    if not full:
        while entries and entries[-1] is None:
            entries = entries[:-1]
    return P(*entries)


def lay_out(model: Net, mesh: Mesh, specs: dict[str, P]) -> Net:
    """Every array leaf `device_put` on `mesh` by hand: `specs[path]`, else
    replicated."""
    dynamic, static = eqx.partition(model, eqx.is_array)
    dynamic = jax.device_put(dynamic, NamedSharding(mesh, P()))
    for path, spec in specs.items():
        get = operator.attrgetter(path)
        dynamic = eqx.tree_at(
            get, dynamic, jax.device_put(get(dynamic), NamedSharding(mesh, spec))
        )
    return eqx.combine(dynamic, static)


def _by_hand(
    model: Net, mesh: Mesh, specs: dict[str, P], preset: str
) -> tuple[Net, eo.Policy]:
    policy = getattr(eo.Policy, preset)(
        update="streamed",  # the streamed loop
        loss_axes="explicit",  # `Net` is written for explicit sharding
    )
    return eo.place(lay_out(model, mesh, specs), policy), policy


def _declared(
    model: Net, mesh: Mesh, specs: dict[str, P], preset: str
) -> tuple[Net, eo.Policy]:
    """The same specs as `Policy(shard=...)` rules, by leaf path; a stacked leaf's
    rule describes one layer."""
    rules = {}
    for path, spec in specs.items():
        if path.startswith("blocks.layers."):
            path, spec = path.replace("blocks.layers.", "blocks."), P(*tuple(spec)[1:])
        rules[path] = spec
    # `loss_axes="auto"` (the default): on `Explicit` axes the loss runs on `Auto`
    # ones, where `Net`'s own resharding is a no-op.
    policy = getattr(eo.Policy, preset)(shard=rules, update="streamed")
    return eo.place(model, policy, mesh=mesh), policy


# How a model gets onto the mesh under a preset: `(model, mesh, whole-array specs,
# preset) -> (placed model, the policy to train it with)`.
LAYOUTS: dict[str, Callable[[Net, Mesh, dict[str, P], str], tuple[Net, eo.Policy]]] = {
    "by hand": _by_hand,
    "declared": _declared,
}


# --- The one-device reference --------------------------------------------------

# Updates Lipschitz in the gradient (`numerics.TRAINED`); with momentum, optimizer
# state that the streamed update reads and writes a layer at a time.
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


def start() -> list[np.ndarray]:
    """The parameters every run starts from, in `Net`'s leaf order."""
    net = Net(key=jax.random.key(0))
    return [np.asarray(p) for p in jax.tree.leaves(eqx.filter(net, eqx.is_array))]


@functools.cache
def reference(optimizer_name: str) -> tuple[list[float], list[np.ndarray]]:
    """Losses and final parameters of plain Equinox + optax on one device."""
    net = Net(key=jax.random.key(0))
    model = ReferenceNet(list(net.blocks), net.head)
    optimizer = OPTIMIZERS[optimizer_name]()
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, state = optimizer.update(grads, state, params)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for x, y in batches():
        model, state, loss = step(model, state, x, y)
        losses.append(float(loss))
    # In `Net`'s leaf order: the blocks' leaves stacked.
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *model.blocks)
    params = jax.tree.leaves(eqx.filter((stacked, model.head), eqx.is_array))
    return losses, [np.asarray(p) for p in params]


# --- Reading the compiled program ----------------------------------------------

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.-]+ = (?P<type>.+?) (?P<op>[a-z][a-z0-9-]*)\("
)
_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def instructions(hlo: str) -> Iterator[tuple[str, list[tuple[int, ...]], str]]:
    """`(opcode, result shapes, JAX op_name)` of every instruction, fusions'
    insides included. Shapes in a compiled SPMD program are per device."""
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name = re.search(r'op_name="([^"]*)"', line)
        shapes = [
            tuple(int(d) for d in dims.split(",") if d)
            for dims in _SHAPE.findall(m["type"])
        ]
        yield m["op"], shapes, name[1] if name else ""


SLICES = ("dynamic_slice", "dynamic_update_slice")  # JAX op names in the update


def assert_streamed(hlo: str, model: Net, with_state: bool) -> None:
    """The update loop reads and writes one layer of each device's shard of the
    host-resident stacked weights (their state and gradients), and no collective
    anywhere gathers a stack of layers."""
    ops = list(instructions(hlo))
    for attribute in STREAMED:
        leaf = operator.attrgetter(attribute)(model)
        shard = leaf.sharding.shard_shape(leaf.shape)
        assert shard != leaf.shape  # the check below tells a shard from the whole
        piece = (1,) + shard[1:]
        # Host-resident between steps: a per-device shard in host memory (S(5)).
        dims = ",".join(map(str, shard))
        assert re.search(rf"f32\[{dims}\]\{{[0-9,]*:S\(5\)\}}", hlo.splitlines()[0])
        path = attribute.replace("blocks.layers.", "blocks.")
        scopes = [path, f"grad.{path}"] + ([f"opt_state.{path}"] * with_state)
        for scope in scopes:
            found: dict[str, set] = {k: set() for k in SLICES}
            for _, shapes, name in ops:
                if f"/{scope}/" in name and "/while/body/" in name:
                    kind = name.rsplit("/", 1)[-1]
                    if kind in found:
                        found[kind].update(shapes)
            # Read: one layer of this device's shard, in a loop over the layers.
            assert found["dynamic_slice"] == {piece}, (scope, found)
            if not scope.startswith("grad."):  # written back into its own shard
                assert found["dynamic_update_slice"] == {shard}, (scope, found)
    gathered = [s for op, out, _ in ops if op.startswith("all-gather") for s in out]
    assert gathered  # FSDP gathers, one layer at a time
    assert not [s for s in gathered if len(s) > 1 and s[0] == DEPTH], gathered
    for op, _, name in ops:
        if op.startswith(("all-", "collective", "reduce-scatter")):
            assert "/opt_state." not in name and "/grad." not in name, (op, name)


def shardings(tree: PyTree) -> list:
    return [x.sharding for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


# --- The matrix ----------------------------------------------------------------

# (layout, mesh, preset, optimizer, axis type, spelling): each preset, each
# optimizer, each axis type and each spelling on each mesh at least once; the
# streamed update (`offload_all`) on both meshes and axis types, with state
# (momentum) and without (SGD); declared layouts on both meshes and axis types.
CASES = [
    ("by hand", "8", "none", "sgd", "Explicit", "short"),
    ("by hand", "8", "offload_all", "momentum", "Auto", "full"),
    ("by hand", "4x2", "offload_residuals", "sgd", "Auto", "short"),
    ("by hand", "4x2", "offload_all", "momentum", "Explicit", "full"),
    ("declared", "8", "offload_all", "sgd", "Auto", "short"),
    ("declared", "4x2", "offload_all", "momentum", "Explicit", "short"),
]


@pytest.mark.parametrize(
    "layout, mesh_name, preset, optimizer_name, axis, spelling", CASES
)
def test_trains_like_one_device(
    layout, mesh_name, preset, optimizer_name, axis, spelling
):
    shape, names, whole_specs = MESHES[mesh_name]
    axis_type = getattr(AxisType, axis)
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    assert mesh.size == 8
    net = Net(key=jax.random.key(0))
    specs = {
        path: spelled(spec, operator.attrgetter(path)(net).ndim, spelling == "full")
        for path, spec in whole_specs.items()
    }
    optimizer = OPTIMIZERS[optimizer_name]()
    model, policy = LAYOUTS[layout](net, mesh, specs, preset)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    host = "pinned_host" if preset == "offload_all" else "device"
    for path, spec in whole_specs.items():
        leaf = operator.attrgetter(path)(model)
        assert spelled(leaf.sharding.spec, leaf.ndim, True) == spelled(
            spec, leaf.ndim, True
        )
        assert leaf.sharding.memory_kind == host
    before = shardings((model, opt_state))

    step = eo.train_step(loss_fn, optimizer, policy)
    data = [
        tuple(jax.device_put(a, NamedSharding(mesh, P("fsdp"))) for a in batch)
        for batch in batches()
    ]
    if preset == "offload_all":
        # Traced as the step traces it (in the mesh its arguments are laid out on).
        traced = step.trace(model, opt_state, *data[0])
        hlo = traced.lower().compile().as_text()
        assert hlo is not None
        assert_streamed(hlo, model, with_state=optimizer_name == "momentum")
    losses = []
    counted = CountCompiles(step)
    for x, y in data:
        model, opt_state, loss, _ = counted(model, opt_state, x, y)
        losses.append(float(loss))
    # Outputs feed the next call as they are: nothing compiles after the first
    # call (nor on it, where the program compiled above is the one it runs).
    assert set(counted.compiled_on) <= {0}

    # Every output leaf in its input's layout and memory kind.
    assert shardings((model, opt_state)) == before
    for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        assert x.sharding.memory_kind == host
    for x in jax.tree.leaves(eqx.filter(opt_state, eqx.is_array)):  # counts: device
        assert x.sharding.memory_kind == (host if x.ndim else "device")

    ref_losses, ref_params = reference(optimizer_name)
    assert_close(losses, ref_losses)
    assert excess(scaled(losses, 1.01), ref_losses) > 10
    assert_close(model, ref_params, tol=TRAINED, origin=start(), steps=STEPS)

    # One compile per input shape: a batch of another size compiles once more, and
    # the first size is still cached (on each axis type, the specs spelled out).
    if preset == "offload_all" and spelling == "full":
        wide = batches(2 * BATCH)[0]
        wide = [jax.device_put(a, NamedSharding(mesh, P("fsdp"))) for a in wide]
        model, opt_state, _, _ = counted(model, opt_state, *wide)
        model, opt_state, _, _ = counted(model, opt_state, *data[0])
        assert [i for i in counted.compiled_on if i] == [len(data)]


# --- An unmodified model on `Explicit` axes -------------------------------------

SEQ = 4


def lm_loss(
    model: LM, tokens: Int[Array, "n seq"], targets: Int[Array, "n seq"]
) -> tuple[Float[Array, ""], Float[Array, " n"]]:
    """The loss of a language model written for one device, with nothing about
    meshes in it: `jax.vmap(self.embed)(tokens)` in the model, and its logits
    written into a cache one position at a time with `.at[].set`, as a decoder
    fills its KV cache. Under `Explicit` axes JAX refuses both (a lookup of token
    ids split over the batch; a split row written into a cache made whole)."""
    logits = jax.vmap(model)(tokens)
    cache = jnp.zeros(logits.shape)
    cache = jax.lax.fori_loop(0, SEQ, lambda i, c: c.at[:, i].set(logits[:, i]), cache)
    losses = optax.softmax_cross_entropy_with_integer_labels(cache, targets)
    return losses.mean(), losses.mean(axis=1)


def test_an_unmodified_model_trains_on_explicit_axes_as_on_auto_axes():
    """`Policy(loss_axes="auto")`, the default: on a mesh with `Explicit` axes the
    loss runs on `Auto` axes inside the step, so the model above trains under a
    declared FSDP layout with `offload_all` as it does on an `Auto` mesh (SGD:
    the losses and the parameters' updates agree to float32 rounding). Its `aux`
    comes back replicated; the backward pass saves what it saves there; `verify`
    passes."""
    rng = np.random.default_rng(0)
    steps = 3
    data = [
        tuple(rng.integers(0, 32, (BATCH, SEQ)).astype(np.int32) for _ in "xy")
        for _ in range(steps)
    ]
    net = LM(key=jax.random.key(0))
    optimizer = optax.sgd(0.5)
    policy = eo.Policy.offload_all(shard=eo.FSDP("fsdp", min_size=0), batch="fsdp")
    runs = {}
    for axis in ("Auto", "Explicit"):
        mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(getattr(AxisType, axis),))
        model = eo.place(net, policy, mesh=mesh)
        opt_state = eo.init_opt_state(optimizer, model, policy)
        before = shardings((model, opt_state))
        step = CountCompiles(eo.train_step(lm_loss, optimizer, policy, has_aux=True))
        losses = []
        for tokens, targets in data:
            model, opt_state, (loss, aux), _ = step(model, opt_state, tokens, targets)
            losses.append(float(loss))
        assert step.compiled_on == [0]
        assert shardings((model, opt_state)) == before
        params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
        assert {x.sharding.memory_kind for x in params} == {"pinned_host"}
        # What the backward pass saves, as `memory_report` lists it.
        loss = eo.filter_offload(lambda m, t, y: lm_loss(m, t, y)[0], policy)
        with jax.set_mesh(mesh):
            saved = saved_for_backward(loss, model, tokens, targets).rows
        runs[axis] = losses, [np.asarray(x) for x in params], aux, saved
    (auto_losses, auto_params, auto_aux, auto_saved), (losses, params, aux, saved) = (
        runs.values()
    )
    # The parameters cast onto `Auto` axes are the same buffers, not residuals.
    assert saved == auto_saved
    assert_close(losses, auto_losses)
    assert excess(scaled(losses, 1.01), auto_losses) > 10
    origin = jax.tree.leaves(eqx.filter(net, eqx.is_array))
    assert_close(params, auto_params, tol=TRAINED, origin=origin, steps=steps)
    assert_close(aux, auto_aux)
    assert excess(scaled(aux, 1.01), auto_aux) > 10
    assert aux.sharding.spec == P(None)  # replicated

    # `verify` runs the loss (and its plain reference) as the step does.
    whole = eo.Policy.offload_all(
        shard=eo.FSDP("fsdp", min_size=0), batch="fsdp", update="whole"
    )
    step = eo.train_step(lm_loss, optimizer, whole, has_aux=True)
    eo.verify(step, model, opt_state, *data[0])

    # Opted in to `Explicit` axes inside the loss: JAX's refusal, as in plain JAX.
    policy = eo.Policy.offload_all(
        shard=eo.FSDP("fsdp", min_size=0), batch="fsdp", loss_axes="explicit"
    )
    step = eo.train_step(lm_loss, optimizer, policy, has_aux=True)
    with pytest.raises(Exception, match=r"out_sharding"):
        step(model, opt_state, *data[0])
