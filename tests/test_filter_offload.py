"""`eo.filter_offload`: values and gradients of the plain Equinox function under every
policy, checkpoint names where the policy selects them, and the mistakes (names that
never occur, a closed-over model, host layers used outside their scan) named."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import eqx_offload as eo
from eqx_offload.internal import saved_residuals, UnusedName

from .helpers import (
    all_eqns,
    as_reference,
    assert_trees_equal,
    batches,
    Block,
    cross_entropy,
    loss_with_l2,
    Model,
    Outer,
    primitive_names,
    table_lm,
)
from .numerics import assert_close, BF16_COMPUTE, excess, scaled


def assert_same_values(ours, reference):
    """`ours` is `reference` computed another way (a scan, offloaded or
    recomputed residuals), to float32 rounding; values 1% too large are caught."""
    assert_close(ours, reference)
    assert excess(scaled(ours, 1.01), reference) > 10


def params(model):
    return model.embed, model.blocks, model.head


@pytest.fixture(scope="module")
def plain():
    """A model, a batch, and plain Equinox's loss (with an L2 penalty) and
    gradients, in the model's order (the blocks' stacked): the reference for every
    policy, computed once."""
    model = Model(dim=8, depth=2, key=jax.random.key(3))
    batch = next(batches())
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_with_l2))
    loss, grads = value_and_grad(as_reference(model), *batch)
    grads = (grads.embed, eo.Stacked.from_layers(grads.blocks), grads.head)
    return model, batch, (loss, grads)


# Without a checkpoint, recomputing the layers, and saving or offloading named
# residuals (`remat` recomputes as `save=` does, saving only the carry: its
# training is compared in `test_train_step.py`).
POLICIES = [
    eo.Policy.none(),
    eo.Policy.offload_residuals(),
    eo.Policy(save=("blocks.mlp.layers[0]",), offload=("blocks.input",)),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.save}-{p.offload}")
def test_values_and_gradients_match_plain_equinox(policy, plain):
    model, batch, reference = plain
    fn = eqx.filter_jit(
        eqx.filter_value_and_grad(eo.filter_offload(loss_with_l2, policy))
    )
    loss, grads = fn(model, *batch)
    assert_same_values((loss, params(grads)), reference)


def test_composes_with_jax_grad_jit_and_as_a_decorator(getkey):
    stacked = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey())
    params, static = eqx.partition(stacked, eqx.is_array)
    x = jnp.ones(4)

    # The two halves of a partitioned model are both arguments, so both are
    # configured and `eqx.combine` sees matching pytrees.
    @eo.filter_offload(policy=eo.Policy(offload=("input",)))
    def f(params, static, x):
        return jnp.sum(jnp.tanh(eqx.combine(params, static)(x)))

    g = jax.jit(jax.grad(f), static_argnums=1)(params, static, x)
    g_ref = jax.jit(
        jax.grad(lambda p, x: jnp.sum(jnp.tanh(eqx.combine(p, static)(x))))
    )(params, x)
    assert_same_values(g, g_ref)
    assert f.__name__ == "f"


def checkpointed_bodies(jaxpr):
    """The jaxprs wrapped in `jax.checkpoint` inside scans."""
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name == "scan":
            for inner in eqn.params["jaxpr"].jaxpr.eqns:
                if inner.primitive.name == "remat2":
                    yield eqn.params["jaxpr"].jaxpr, inner


def test_carry_is_named_first_inside_the_checkpointed_body(getkey):
    model = table_lm(getkey(), dim=8, depth=2)
    tokens, targets = next(batches())
    fn = eo.filter_offload(cross_entropy, eo.Policy.offload_residuals())
    # The forward function: under `grad`, partial evaluation consumes the checkpoint.
    jaxpr = eqx.filter_make_jaxpr(fn)(model, tokens, targets)[0]
    bodies = list(checkpointed_bodies(jaxpr))
    assert bodies
    for scan_body, remat in bodies:
        inner = remat.params["jaxpr"]
        first = inner.eqns[0]
        assert first.primitive.name == "name"
        assert first.params["name"] == "blocks.input"
        # ...applied to the carry (the scan body's first non-constant input).
        carry_position = remat.invars.index(scan_body.invars[0])
        assert first.invars[0] is inner.invars[carry_position]


def names_in(fn, *args):
    jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(fn))(*args)[0]
    return {e.params["name"] for e in all_eqns(jaxpr) if e.primitive.name == "name"}


def test_submodule_outputs_are_named_only_when_a_pattern_matches(getkey):
    model = Model(key=getkey())
    batch = next(batches())
    plain = eo.filter_offload(cross_entropy, eo.Policy.remat())
    assert names_in(plain, model, *batch) == {"blocks.input"}
    policy = eo.Policy(save=("blocks.mlp.layers[*]",), offload=("**.input",))
    named = eo.filter_offload(cross_entropy, policy)
    assert names_in(named, model, *batch) == {
        "blocks.input",
        "blocks.mlp.layers[0]",
        "blocks.mlp.layers[1]",
    }
    assert model.blocks.layers.mlp.__class__ is eqx.nn.MLP  # the model is unchanged


def test_named_submodules_keep_their_type(getkey):
    seen = []

    class Checking(Block):
        def __call__(self, x):
            seen.append(type(self.mlp))
            assert isinstance(self.mlp, eqx.nn.MLP)
            return super().__call__(x)

    blocks = eo.Stacked.from_fn(
        lambda k: Checking(8, 2, key=k),  # pyright: ignore[reportCallIssue]
        2,
        key=getkey(),
    )
    policy = eo.Policy(save=("mlp",), offload=("input",))
    # 'mlp' (added to the residual stream) is not a residual, but it is named:
    fn = eo.filter_offload(lambda b, x: jnp.sum(b(x)), policy)
    with pytest.raises(ValueError, match="'mlp', which occurred"):
        eqx.filter_grad(fn)(blocks, jnp.ones((3, 8)))
    assert seen and all(issubclass(t, eqx.nn.MLP) and t is not eqx.nn.MLP for t in seen)


def test_user_names_inside_a_layer_can_be_selected(getkey):
    class Named(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return x + jnp.sin(checkpoint_name(self.lin(x), "hidden"))

    blocks = eo.Stacked.from_fn(
        lambda k: Named(eqx.nn.Linear(4, 4, key=k)), 3, key=getkey()
    )
    fn = eo.filter_offload(
        lambda b, x: jnp.sum(b(x) ** 2), eo.Policy(offload=("hidden",))
    )
    g = eqx.filter_jit(eqx.filter_grad(fn))(blocks, jnp.ones(4))
    g_ref = eqx.filter_jit(eqx.filter_grad(lambda b, x: jnp.sum(b(x) ** 2)))(
        blocks, jnp.ones(4)
    )
    assert_same_values(g, g_ref)


def test_name_that_never_occurs_lists_the_names_that_did(getkey):
    fn = eo.filter_offload(cross_entropy, eo.Policy(offload=("blok.input",)))
    with pytest.raises(
        ValueError,
        match=r"`Policy\(offload=\.\.\.\)` names 'blok\.input', which never occurred; "
        r"names seen: 'blocks\.input'\. Names this model offers \(saved for the "
        r"backward pass, so a policy can select them\): 'blocks\.input', "
        r"'blocks\.norm1', .*'blocks\.mlp\.layers\[0\]'; `eqx_offload\.checkpoint",
    ) as error:
        eqx.filter_grad(fn)(Model(key=getkey()), *next(batches()))
    # Only residuals are offered: the MLP's output and its last layer's are not.
    assert "'blocks.mlp'" not in str(error.value)
    assert "'blocks.mlp.layers[1]'" not in str(error.value)
    assert isinstance(error.value, UnusedName)  # the names as data, too
    assert error.value.offered[:2] == ("blocks.input", "blocks.norm1")


def test_pattern_that_never_occurs_is_an_error(getkey):
    fn = eo.filter_offload(cross_entropy, eo.Policy(save=("decoder.*",)))
    with pytest.raises(
        ValueError, match=r"`Policy\(save=\.\.\.\)` names 'decoder\.\*'"
    ):
        eqx.filter_grad(fn)(Model(key=getkey()), *next(batches()))


def test_policy_names_without_any_stacked_is_an_error():
    traces = []

    def loss(x):
        traces.append(x.shape)
        return jnp.sum(x**2)

    fn = eo.filter_offload(loss, eo.Policy.offload_residuals())
    with pytest.raises(
        ValueError, match=r"never occurred; names seen: \(none: no `Stacked`\)"
    ):
        jax.grad(fn)(jnp.ones(3))
    # Traced for the call, and again for the names it could offer (each time once
    # more from the jaxpr, for scans an inner jit's cache served); the hint's own
    # error asks for no hint of its own.
    assert len(traces) == 4


def test_name_that_is_not_a_residual_is_an_error(getkey):
    # A block's output (here: the MLP's, added to the residual stream) is not a
    # residual of that block: offloading it would silently do nothing. The error
    # lists every residual name the model offers, not only the ones traced.
    fn = eo.filter_offload(cross_entropy, eo.Policy(offload=("blocks.mlp",)))
    with pytest.raises(
        ValueError,
        match=r"names 'blocks\.mlp', which occurred \('blocks\.mlp'\) but is not saved "
        r"for the backward pass.*Names this model offers.*'blocks\.input', "
        r"'blocks\.norm1', .*'blocks\.attn', 'blocks\.norm2', "
        r"'blocks\.mlp\.layers\[0\]';",
    ):
        eqx.filter_grad(fn)(Model(key=getkey()), *next(batches()))
    # ... and each of them works (the names are checked as the step is traced).
    fn = eo.filter_offload(cross_entropy, eo.Policy(offload=("blocks.mlp.layers[0]",)))
    eqx.filter_eval_shape(eqx.filter_grad(fn), Model(key=getkey()), *next(batches()))


def test_a_preset_whose_offload_is_replaced_says_so():
    with pytest.warns(
        UserWarning,
        match=r"`Policy\.offload_all\(offload=\('blocks\.mlp\.layers\[0\]',\)\)` "
        r"replaces the preset's `offload=\('\*\*\.input',\)`: the carry entering each "
        r"layer .* is no longer offloaded .*`Policy\(params='pinned_host', "
        r"opt_state='pinned_host', offload=\('blocks\.mlp\.layers\[0\]',\)\)`",
    ) as got:
        policy = eo.Policy.offload_all(offload=("blocks.mlp.layers[0]",))
    assert got[0].filename == __file__
    assert policy.offload == ("blocks.mlp.layers[0]",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eo.Policy.offload_residuals(offload=("**.input", "blocks.mlp.layers[0]"))
        eo.Policy(offload=("blocks.mlp.layers[0]",))


def test_same_path_in_two_arguments_is_an_error(getkey):
    fn = eo.filter_offload(lambda a, b, x: jnp.sum(a(x) + b(x)), eo.Policy.remat())
    a = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(2, 2, key=k), 2, key=getkey())
    with pytest.raises(
        ValueError, match=r"argument 0 and argument 1 both hold a `Stacked` at ''"
    ):
        fn(a, a, jnp.ones(2))
    b = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(2, 2, key=k), 2, key=getkey())
    nested = eo.filter_offload(
        lambda a, b, x: jnp.sum(a(x) + b[0](x)), eo.Policy.remat()
    )
    nested(a, [b], jnp.ones(2))  # different paths: '' and '[0]'


def test_partitioned_halves_may_share_a_path(plain):
    model, batch, (_, ref) = plain
    # Freeze the attention: its arrays go in the static half.
    frozen = eqx.tree_at(
        lambda m: m.blocks.layers.attn, model, replace_fn=lambda _: None
    )
    spec = jax.tree.map(lambda _: True, frozen)
    spec = eqx.tree_at(
        lambda m: m.blocks.layers.attn,
        spec,
        jax.tree.map(lambda _: False, model.blocks.layers.attn),
        is_leaf=lambda x: x is None,
    )
    diff, static = eqx.partition(model, spec)

    def loss(diff, static, tokens, targets):
        return loss_with_l2(eqx.combine(diff, static), tokens, targets)

    fn = eo.filter_offload(loss, eo.Policy.offload_residuals())
    grads = eqx.filter_jit(eqx.filter_grad(fn))(diff, static, *batch)
    # The other parameters' gradients are the whole model's.
    ref = eqx.tree_at(lambda g: g[1].layers.attn, ref, replace_fn=lambda _: None)
    assert_same_values(params(grads), ref)


def test_closed_over_model_is_an_error(getkey):
    model = Model(key=getkey())
    tokens, targets = next(batches())
    fn = eo.filter_offload(
        lambda t: cross_entropy(model, t, targets), eo.Policy.remat()
    )
    with pytest.raises(ValueError, match="it was closed over, or rebuilt"):
        fn(tokens)


def test_nested_stacked_and_slices_are_configured(getkey):
    def make(k):
        return Outer(
            eo.Stacked.from_fn(lambda k2: eqx.nn.Linear(3, 3, key=k2), 2, key=k)
        )

    outer = eo.Stacked.from_fn(make, 3, key=getkey())
    x = jnp.ones(3)
    policy = eo.Policy(offload=("inner.input",))
    fn = eo.filter_offload(lambda s, x: jnp.sum(s(x) + s[1:](x)), policy)
    assert names_in(fn, outer, x) == {"input", "inner.input"}
    g = eqx.filter_jit(eqx.filter_grad(fn))(outer, x)
    g_ref = eqx.filter_jit(eqx.filter_grad(lambda s, x: jnp.sum(s(x) + s[1:](x))))(
        outer, x
    )
    assert_same_values(g, g_ref)


def test_host_stacked_leaf_used_outside_the_scan_is_an_error(getkey):
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    fn = eo.filter_offload(loss_with_l2, policy)
    with pytest.raises(
        ValueError,
        match=r"leaf 'blocks\.norm1\.weight' of argument 0 is a host-resident layer of "
        r"the `Stacked` at 'blocks'.*\(by `integer_pow`\).*optax\.add_decayed_weights.*"
        r"Policy\(params=\{'blocks': 'device'\}\)",
    ):
        eqx.filter_grad(fn)(model, *next(batches()))


def test_misuse_is_found_through_nested_calls(getkey):
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)

    @jax.jit
    def penalty(w):
        return jnp.sum(w)

    def loss(model, tokens, targets):
        return cross_entropy(model, tokens, targets) + penalty(
            model.blocks.layers.mlp.layers[0].weight
        )

    with pytest.raises(
        ValueError, match=r"'blocks\.mlp\.layers\[0\]\.weight'.*\(by `reduce_sum`\)"
    ):
        eqx.filter_grad(eo.filter_offload(loss, policy))(model, *next(batches()))


def test_host_leaves_outside_stacked_are_moved_at_the_start(plain):
    policy = eo.Policy(params={"embed": "pinned_host", "head": "pinned_host"})
    base, batch, reference = plain
    model = eo.place(base, policy)
    fn = eo.filter_offload(loss_with_l2, policy)  # L2 over host leaves is fine here
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(fn))(model, *batch)
    assert_same_values((loss, params(grads)), reference)
    assert grads.embed.weight.sharding.memory_kind == "pinned_host"
    assert grads.head.weight.sharding.memory_kind == "pinned_host"
    jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(fn))(model, *next(batches()))[0]
    first_ops = [e.primitive.name for e in jaxpr.jaxpr.eqns[:3]]
    assert first_ops == ["device_put"] * 3  # embed.weight, head.weight, head.bias


def test_decorates_a_method(plain):
    class Trainer(eqx.Module):
        model: Model

        @eo.filter_offload(policy=eo.Policy.offload_residuals())
        def loss(self, tokens, targets):
            return loss_with_l2(self.model, tokens, targets)

    model, batch, (_, ref) = plain
    trainer = Trainer(model)
    grads = eqx.filter_jit(eqx.filter_grad(lambda t, *b: t.loss(*b)))(trainer, *batch)
    assert_same_values(params(grads.model), ref)
    assert per_layer_residuals_on_host(lambda t, *b: t.loss(*b), trainer, *batch)
    assert Trainer.loss.__name__ == "loss"


def test_policy_is_required():
    with pytest.raises(TypeError, match="needs a policy"):
        eo.filter_offload(lambda x: x)  # pyright: ignore[reportCallIssue]


def per_layer_residuals_on_host(fn, *args):
    residuals = [r for r in saved_residuals(fn, *args) if r.per_iteration]
    return bool(residuals) and all(r.host for r in residuals)


def test_inner_jit_caches_do_not_mix_policies(getkey):
    # An inner jitted function sees the configured `Stacked` in its arguments, so
    # its trace cache keys on the policy: a plain trace is never reused for an
    # offloaded call, nor an offloaded one for a plain call or another policy.
    model = Model(key=getkey())
    batch = next(batches())
    forward = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))

    def loss(model, tokens, targets):
        logits = forward(model, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    plain = forward(model, batch[0])  # traced without any policy first
    offload = eo.filter_offload(loss, eo.Policy.offload_residuals())
    for _ in range(2):  # the second trace hits the inner cache: no false name error
        eqx.filter_eval_shape(eqx.filter_grad(offload), model, *batch)
    assert per_layer_residuals_on_host(offload, model, *batch)
    saving = eo.filter_offload(loss, eo.Policy(save=("blocks.input",)))
    eqx.filter_eval_shape(eqx.filter_grad(saving), model, *batch)
    residuals = [r for r in saved_residuals(saving, model, *batch) if r.per_iteration]
    assert residuals and not any(r.host for r in residuals)
    # The plain program, compiled once: its result again, bit for bit.
    assert_trees_equal(forward(model, batch[0]), plain)
    jaxpr = eqx.filter_make_jaxpr(forward)(model, batch[0])[0]
    assert "remat2" not in primitive_names(jaxpr) and "name" not in primitive_names(
        jaxpr
    )


def test_checkpoint_around_the_model_is_fine(plain):
    model, batch, (_, ref) = plain

    def loss(model, tokens, targets):
        return eqx.filter_checkpoint(loss_with_l2)(model, tokens, targets)

    policy = eo.Policy.offload_residuals()
    fn = eqx.filter_jit(eqx.filter_grad(eo.filter_offload(loss, policy)))
    for _ in range(2):  # and again, from the caches
        assert_same_values(params(fn(model, *batch)), ref)


def test_casting_the_model_inside_the_function(getkey):
    model, batch = table_lm(getkey(), dim=8, depth=2), next(batches())

    def loss(model, tokens, targets):
        model = jax.tree.map(
            lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model
        )
        return cross_entropy(model, tokens, targets).astype(jnp.float32)

    fn = eo.filter_offload(loss, eo.Policy.offload_residuals())
    grads = eqx.filter_jit(eqx.filter_grad(fn))(model, *batch)
    ref = eqx.filter_jit(eqx.filter_grad(loss))(model, *batch)
    # The same bf16 computation, its residuals offloaded: bf16 rounding can land
    # on the other neighbour where the float32 values differ by their own rounding.
    assert_close(grads, ref, tol=BF16_COMPUTE)
    assert excess(scaled(grads, -1), ref, tol=BF16_COMPUTE) > 10  # a wrong sign
    assert per_layer_residuals_on_host(fn, model, *batch)


def test_forward_only_control_flow_over_host_layers_is_fine(getkey):
    policy = eo.Policy.offload_all()
    model = eo.place(Model(key=getkey()), policy)
    tokens, _ = next(batches())

    def through_map(model, tokens):  # a scan over the batch, the model a constant
        return jax.lax.map(model, tokens)

    def through_cond(model, tokens):
        zeros = jnp.zeros((*tokens.shape, 32))
        return jax.lax.cond(True, lambda: jax.vmap(model)(tokens), lambda: zeros)

    on_device = eo.place(model, eo.Policy(params="device"))
    expected = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(on_device, tokens)
    for fn in (through_map, through_cond):
        out = eqx.filter_jit(eo.filter_offload(fn, policy))(model, tokens)
        assert_same_values(out, expected)


def test_stacked_of_stacked_is_a_clear_error(getkey):
    inner = eo.Stacked.from_fn(lambda k: eqx.nn.Linear(3, 3, key=k), 2, key=getkey())
    outer = eo.Stacked(jax.tree.map(lambda x: jnp.stack([x, x]), inner))
    fn = eo.filter_offload(lambda s, x: jnp.sum(s(x)), eo.Policy.remat())
    with pytest.raises(ValueError, match="are themselves a `Stacked`"):
        fn(outer, jnp.ones(3))


def test_misuse_message_for_a_stacked_argument(getkey):
    stacked = eo.place(
        eo.Stacked.from_fn(lambda k: eqx.nn.Linear(3, 3, key=k), 2, key=getkey()),
        eo.Policy(params="pinned_host"),
    )
    fn = eo.filter_offload(
        lambda s, x: jnp.sum(s(x)) + jnp.sum(s.layers.weight), eo.Policy.remat()
    )
    with pytest.raises(ValueError, match=r"`Policy\(params='device'\)`"):
        fn(stacked, jnp.ones(3))
