"""The three experiments of the JAX host-offloading tutorial, written as in the
tutorial with plain JAX and again with eqx_offload, compiled (never run) on this CPU
and for one TPU v5e chip.

    python benchmarks/tutorial.py [--targets cpu tpu-v5e] [--json FILE]

The tutorial's printed figures come from a GPU; the baselines here are its recipes
recompiled with `eo.memory_report`. Its `out_shardings=s_host` is written as a
`device_put` to `jax.memory.Space.Host` at the end of the step so that one recipe
compiles for every target. The eqx_offload models and losses are those of
`examples/offloading_tutorial.py`.
"""

import _common  # noqa: F401  (sets JAX_PLATFORMS before JAX is imported)
import jax
import jax.numpy as jnp
import optax
from _common import example, MIB, parser, table, write_json
from jax.ad_checkpoint import checkpoint_name

import eqx_offload as eo


_tutorial = example("offloading_tutorial")
TwoLayers, stacked_loss = _tutorial.TwoLayers, _tutorial.stacked_loss
optimizer, compute_loss = _tutorial.optimizer, _tutorial.compute_loss
gelu = _tutorial.gelu


# --- Experiments 1 and 2: a 10-layer scan of two matmuls -----------------------

N, IN, HIDDEN = 10, 256, 1024
x = jax.ShapeDtypeStruct((IN, IN), jnp.float32)
w1 = jax.ShapeDtypeStruct((N, IN, HIDDEN), jnp.float32)
w2 = jax.ShapeDtypeStruct((N, HIDDEN, IN), jnp.float32)
offload_x = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["x"],
    offload_src="device",
    offload_dst="pinned_host",
)


def two_layers(x, w):
    w1, w2 = w
    y = x @ w1
    return y @ w2, None


def tutorial_no_offload(w, x):
    return jnp.sum(jax.lax.scan(two_layers, x, w)[0])


def layer_name(x, w):
    w1, w2 = w
    x = checkpoint_name(x, "x")
    y = x @ w1
    return y @ w2, None


def tutorial_activation_offload(w, x):
    remat_layer = jax.remat(layer_name, policy=offload_x, prevent_cse=False)
    return jnp.sum(jax.lax.scan(remat_layer, x, w)[0])


def hybrid_layer(x, w):
    w1, w2 = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), w)
    x = checkpoint_name(x, "x")
    y = x @ w1
    return y @ w2, None


def tutorial_parameter_offload(w, x):
    remat_layer = jax.remat(hybrid_layer, policy=offload_x, prevent_cse=False)
    return jnp.sum(jax.lax.scan(remat_layer, x, w)[0])


def experiments_1_and_2():
    """(name, experiment, function, arguments), all gradients of the same loss."""
    w = (w1, w2)
    w_host = eo.place(w, eo.Policy(params="pinned_host"))
    stacked = jax.eval_shape(
        lambda: eo.Stacked(TwoLayers(jnp.zeros(w1.shape), jnp.zeros(w2.shape)))
    )
    stacked_host = eo.place(stacked, eo.Policy(params="pinned_host"))
    eqx_grad = jax.jit(
        jax.grad(eo.filter_offload(stacked_loss, eo.Policy.offload_residuals()))
    )
    return [
        (
            "plain JAX, no offload",
            "activations",
            jax.jit(jax.grad(tutorial_no_offload)),
            (w, x),
        ),
        (
            "tutorial recipe",
            "activations",
            jax.jit(jax.grad(tutorial_activation_offload)),
            (w, x),
        ),
        (
            "eqx_offload, Policy.offload_residuals()",
            "activations",
            eqx_grad,
            (stacked, x),
        ),
        (
            "tutorial recipe",
            "parameters",
            jax.jit(jax.grad(tutorial_parameter_offload)),
            (w_host, x),
        ),
        (
            "eqx_offload, params on pinned_host",
            "parameters",
            eqx_grad,
            (stacked_host, x),
        ),
    ]


# --- Experiment 3: a dict of four 7168x7168 weights, clip + Adam ---------------

DIM = 7168


def tutorial_step(params, opt_state, inputs):
    grads = jax.grad(lambda p: compute_loss(p, inputs))(params)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state


def tutorial_offload_step(params, opt_state, inputs):
    grads = jax.grad(lambda p: compute_loss(p, inputs))(params)
    opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, jax.device_put(new_opt_state, jax.memory.Space.Host)


def experiment_3():
    inputs = jax.ShapeDtypeStruct((DIM, DIM), jnp.float32)
    params = {
        f"w{i}": jax.ShapeDtypeStruct((DIM, DIM), jnp.float32) for i in range(1, 5)
    }
    params = eo.place(params)
    state = eo.init_opt_state(optimizer, params, eo.Policy.none())
    host_state = eo.init_opt_state(
        optimizer, params, eo.Policy.none(opt_state="pinned_host")
    )
    offload = eo.Policy.none(opt_state="pinned_host")
    return [
        (
            "plain JAX, no offload",
            "optimizer state",
            jax.jit(tutorial_step, donate_argnums=(0, 1)),
            (params, state, inputs),
        ),
        (
            "tutorial recipe",
            "optimizer state",
            jax.jit(tutorial_offload_step, donate_argnums=(0,)),
            (params, host_state, inputs),
        ),
        (
            "eqx_offload, Policy.none()",
            "optimizer state",
            eo.train_step(compute_loss, optimizer, eo.Policy.none()),
            (params, state, inputs),
        ),
        (
            "eqx_offload, opt_state on pinned_host",
            "optimizer state",
            eo.train_step(compute_loss, optimizer, offload),
            (params, host_state, inputs),
        ),
    ]


def main():
    p = parser(__doc__)
    p.add_argument("--targets", nargs="+", default=["cpu", "tpu-v5e"])
    args = p.parse_args()
    results = []
    for name, experiment, fn, fn_args in experiments_1_and_2() + experiment_3():
        row = {"experiment": experiment, "version": name}
        for target in args.targets:
            report = eo.memory_report(
                fn, *fn_args, target=None if target == "cpu" else target
            )
            row[f"{target} device MiB"] = report.device_bytes / MIB
            row[f"{target} host MiB"] = report.host_bytes / MIB
        results.append(row)
        print(f"  {experiment}: {name} done", flush=True)
    headers = list(results[0])
    print()
    print(table(headers, [[r[h] for h in headers] for r in results]))
    print("\n(cpu: estimates by memory kind; the CPU compiler has one memory)")
    write_json(args.json, "tutorial", results)


if __name__ == "__main__":
    main()
