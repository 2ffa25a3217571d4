"""Host copies a GPU can overlap (`gpu_thunks.py`): the `offload_all` step of
a small model, compiled for an H100 without a GPU, as XLA:GPU's thunk sequence
runs it. Every host read and write of the forward, backward and update loops runs
on a copy engine, not as a kernel on the GPU's cores; and in the update loop a
read and a write are in flight together, on different streams, and no read
slices an array the loop has just written (`_update/_piece_loop.py`)."""

import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqx_offload as eo

from . import gpu_thunks as thunks
from .helpers import cross_entropy, table_lm


pytest.importorskip("jax_cuda12_plugin", reason="the `gpu-aot` extra")

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from _compiles import compiles  # noqa: E402


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> thunks.Program:
    """The host transfers of the Adam step of a 3-layer `table_lm` of width 16
    (an update loop of two steps: the last piece is updated after it)."""
    policy = eo.Policy.offload_all()
    abstract = eqx.filter_eval_shape(table_lm, jax.random.key(0), 32, 16, 3)
    model = eo.place(abstract, policy)
    optimizer = optax.adam(1e-3)
    opt_state = eo.init_opt_state(optimizer, model, policy)
    step = eo.train_step(cross_entropy, optimizer, policy)
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    dump = tmp_path_factory.mktemp("dump")
    with compiles(thunks.dump_options(dump)):
        eo.memory_report(step, model, opt_state, tokens, tokens, target="gpu-h100")
    return thunks.read(dump)


def test_the_loops_move_host_data_with_copy_engines(program):
    """A slice of a host array whose offset is not affine in the loop counter (a
    clamped read-ahead, an index read from an array) would be a kernel here."""
    for phase in ("forward", "backward", "update"):
        (loop,) = program.phase(phase)
        directions = {t.direction for t in loop.transfers}
        assert "to device" in directions, (phase, loop)
        kernels = [t for t in loop.transfers if t.engine != "copy"]
        assert not kernels, (phase, kernels)
    (update,) = program.phase("update")
    assert {t.direction for t in update.transfers} == {"to device", "to host"}


def test_the_update_loop_reads_and_writes_at_once(program):
    """The link used both ways: a read and a write in flight together, on
    different streams (so on the two copy engines), and no read of the loop
    slicing an array one of its writes has just written (it would wait for
    that write)."""
    (update,) = program.phase("update")
    both_ways = [
        (a.name, b.name)
        for a, b in update.overlapping()
        if {a.direction, b.direction} == {"to device", "to host"}
        and a.stream != b.stream
    ]
    assert both_ways, update
    waits = [
        (a.name, b.name)
        for a, b in update.waiting()
        if (a.direction, b.direction) == ("to host", "to device")
    ]
    assert not waits, waits
