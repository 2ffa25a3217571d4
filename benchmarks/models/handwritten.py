"""The `Policy.offload_all()` train step of `gpt.GPT` written by hand, the way the
JAX offloading tutorial does it: `lax.scan` over the stacked layer parameters,
`device_put` of each layer's slice inside the scan body, `checkpoint_name` on the
carry, `jax.checkpoint` with `save_and_offload_only_these_names`, the other
parameters moved to the device where the loss starts, and the optimizer state
brought to the device for the update and put back on the host.

The layers' arithmetic is the same Equinox code (`gpt.Block`), so the comparison
with eqx_offload measures the offloading machinery, not two ways of writing a model.
"""

import equinox as eqx
import jax
import optax
from jax.ad_checkpoint import checkpoint_name


Device, Host = jax.memory.Space.Device, jax.memory.Space.Host
POLICY = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["blocks.input"],
    offload_src="device",
    offload_dst="pinned_host",
)


def to_host(tree):
    return jax.tree.map(
        lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), tree
    )


def to_device(tree, space=Device):
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def loss_fn(params, static, tokens, targets):
    model = eqx.combine(params, static)
    layers, layer_static = eqx.partition(model.blocks.layers, eqx.is_array)
    embed, norm, head = eqx.combine(
        to_device(eqx.filter((model.embed, model.norm, model.head), eqx.is_array)),
        (model.embed, model.norm, model.head),
    )

    def block(x, layer):
        x = checkpoint_name(x, "blocks.input")  # first: the residual to offload
        return eqx.combine(to_device(layer), layer_static)(x), None

    block = jax.checkpoint(block, policy=POLICY, prevent_cse=False)

    def forward(tokens):
        x, _ = jax.lax.scan(block, jax.vmap(embed)(tokens), layers)
        return jax.vmap(head)(jax.vmap(norm)(x))

    logits = jax.vmap(forward)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_step(optimizer, static):
    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, static, tokens, targets)
        params, grads, opt_state = to_device((params, grads, opt_state))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return to_device(params, Host), to_device(opt_state, Host), loss

    return jax.jit(step, donate_argnums=(0, 1))


def init_opt_state(optimizer, params):
    """The whole state on the host, as the tutorial keeps it."""
    return to_host(jax.jit(optimizer.init)(params))
