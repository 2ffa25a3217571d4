"""Reading the compiler's text (`_compiler.py`): samples captured with the JAX and
libtpu versions it was checked against (`tests/fixtures/<version>/`, written by
`tests/fixtures/capture.py`) parse to exactly what they say, and this
installation still writes them so: after an upgrade that changes the text, the
comparisons below fail (re-check the parser, then capture the samples again)."""

import importlib.metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from eqx_offload import _compat, _compiler, _compiler_stablehlo, _diagnose
from eqx_offload._report import _compiled_traffic, _costs
from eqx_offload._report._traffic import Transfer

from .fixtures import capture


FIXTURES = Path(__file__).parent / "fixtures" / _compiler.JAX_VERSION
GiB = 2**30


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_checked_against_this_jax():
    assert _compiler.JAX_VERSION == _compat.JAX_VERSION == jax.__version__, (
        f"jax {jax.__version__} is installed; `_compiler.py` and `_compat.py` were "
        f"checked against {_compiler.JAX_VERSION}: check them, run "
        "`python tests/fixtures/capture.py` and update their versions."
    )
    assert FIXTURES.is_dir()
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return
    assert libtpu == _compiler.LIBTPU_VERSION


# Error messages.


def test_out_of_memory_message():
    message = fixture("tpu_out_of_memory.txt")
    assert _compiler.oom_sizes(message) == (64 * GiB, int(15.75 * GiB))


def test_the_shapes_a_rejection_quotes_name_the_leaves():
    """Two rejections captured from this JAX's compilers (a loop over blocks of rows
    nested in a scan's backward pass, which the library no longer builds): the
    array types they are about are read (of an expected and an actual tuple, the
    entries that differ), and the diagnosis names the leaves of those shapes, whole
    or one layer of them; vectors and scalars name none."""
    tpu = fixture("tpu_async_shape.txt")
    assert _compiler.array_shapes(tpu) == [("float32", (2, 512, 2048))]
    gpu = fixture("gpu_expected_shape.txt")  # a loop's tuple of 21 types
    assert _compiler.array_shapes(gpu) == [
        ("float32", (2, 512, 2048)),
        ("float32", (2, 2048, 512)),
    ]
    assert _compiler.array_shapes("bf16[4,8]{1,0:T(8,128)(2,1)} pred[]") == [
        ("bfloat16", (4, 8)),
        ("bool", ()),
    ]

    def streamed(path, shape, rows):
        return _diagnose.Streamed(path, shape, jnp.float32, rows, rows == 1)

    leaves = [
        streamed("blocks.w_up", (2, 512, 2048), 1),
        streamed("blocks.w_down", (2, 2048, 512), 1),
        streamed("blocks.norm", (2, 512), 1),  # a layer of it is a vector
        streamed("head", (4096, 512), 1024),  # blocks of 1024 rows
    ]
    assert _diagnose.leaves_in_message(tpu, leaves) == ["blocks.w_up"]
    assert _diagnose.leaves_in_message(gpu, leaves) == ["blocks.w_up", "blocks.w_down"]
    layer = "copy-start(f32[2048,512]{1,0}) f32[1024,512]"
    assert _diagnose.leaves_in_message(layer, leaves) == ["blocks.w_down", "head"]
    assert _diagnose.leaves_in_message("f32[] s32[] f32[512]", leaves) == []


def test_the_compilers_out_of_memory_figures_are_read():
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
        "HLO temporaries (36.51G) exceeds available HBM (15.75G)."
    )
    assert _compiler.oom_sizes(message) == (int(36.51 * GiB), int(15.75 * GiB))
    used = "Ran out of memory in memory space hbm. Used 20.50G of 15.75G hbm."
    assert _compiler.oom_sizes(used) == (int(20.5 * GiB), int(15.75 * GiB))
    assert _compiler.oom_sizes("something else") == (None, None)


def test_op_names_and_named_scopes():
    text = fixture("tpu_hlo.txt")
    assert _compiler.op_names(text)[:2] == [
        "jit(f)/while/body/closed_call/dot_general",
        "jit(f)/while/body/closed_call/tanh",
    ]
    # JAX's own structure is no named scope.
    assert _compiler.named_scopes("jit(f)/while/body/closed_call/tanh") == []
    step = "jit(_step)/transpose(jvp(vmap(blocks)))/while/body/optimizer_update/mu/mul"
    assert _compiler.named_scopes(step) == ["blocks", "optimizer_update", "mu"]


# StableHLO.


def test_signature_with_aliased_outputs():
    signature = _compiler_stablehlo.signature(fixture("stablehlo_donated.mlir"))
    assert signature == _compiler_stablehlo.Signature(
        ["host", "device", "host"], {1: 0, 2: 1}, ["device", "host", "device"]
    )


def test_signature_with_buffer_donors():
    # The donors are paired with the first free output of their type and memory.
    signature = _compiler_stablehlo.signature(fixture("stablehlo_mesh.mlir"))
    assert signature == _compiler_stablehlo.Signature(
        ["device", "host", "device"], {0: 0, 1: 2}, ["device", "device", "host"]
    )


@pytest.mark.parametrize("name", ["stablehlo_donated.mlir", "stablehlo_mesh.mlir"])
def test_this_jax_lowers_as_the_fixtures_say(name):
    assert capture.TEXTS[name]() == fixture(name)


# HLO compiled for a TPU.


def test_hlo_module():
    module = _compiler.parse_hlo(fixture("tpu_hlo.txt"))
    assert module.entry == "main.5"
    assert len(module.computations) == 6
    main = module.computations["main.5"]
    assert main.root == "copy-done"
    assert main.params == {0: "stack.1", 1: "x.1"}
    loop = main.insts["while"]
    assert loop.opcode == "while" and loop.operands == ["tuple.13"]
    assert loop.computation("body") == "wide.region_0.3.sunk"
    assert loop.computation("condition") == "wide.region_1.4"
    assert loop.known_trip_count is None
    assert main.insts["constant.2"].constant == 1
    stack = main.insts["stack.1"]
    assert stack.parameter_number == 0 and stack.op_name == "stack"
    assert _compiler.arrays(stack.shape) == [_compiler.Array(3 * 128 * 128 * 4, True)]

    condition = module.computations["wide.region_1.4"]
    compare = condition.insts[condition.root]
    assert compare.opcode == "compare" and compare.direction == "LT"
    assert compare.operands == ["get-tuple-element.15", "constant.9"]
    assert condition.insts["get-tuple-element.15"].index == 0

    body = module.computations["wide.region_0.3.sunk"]
    start = body.insts["dynamic-slice-start"]
    elements = _compiler.tuple_elements(start.shape)
    assert elements[1:] == ["f32[1,128,128]{2,1,0:T(8,128)}", "u32[]{:S(2)}"]
    assert _compiler.arrays(elements[0]) == [
        _compiler.Array(3 * 128 * 128 * 4, True),
        *[_compiler.Array(4, False)] * 3,
    ]
    assert start.operands[0] == "get-tuple-element.43"
    fusion = body.insts["fusion.15"]
    assert fusion.computation("calls") == "fused_computation.2.clone.1"


def test_dot_and_convolution_attributes():
    """What the step-time estimate reads of a dot and a convolution (as jax 0.10.2
    with libtpu 0.0.42.1 and the CUDA plugin write them)."""
    convolution = _compiler._instruction(
        "ROOT %convolution-base-dilated.1 = bf16[8,4,256,256]{3,2,1,0:T(8,128)(2,1)} "
        "convolution(%fusion.1, %fusion.2), window={size=8x4 stride=7x3 pad=0_0x1_2 "
        "lhs_dilate=8x4}, dim_labels=01bf_01oi->01bf, operand_precision={highest,"
        'highest}, metadata={op_name="jit(attn)/bhqd,bhkd->bhqk/dot_general"}'
    )
    assert convolution is not None
    assert convolution.dim_labels == "01bf_01oi->01bf"
    assert convolution.window == {
        "size": [8, 4],
        "stride": [7, 3],
        "pad_low": [0, 1],
        "pad_high": [0, 2],
        "lhs_dilate": [8, 4],
    }
    assert convolution.operand_precision == ["highest", "highest"]
    dot = _compiler._instruction(
        "ROOT %dot.1 = f32[4,512,256]{2,1,0} dot(%parameter_0, %parameter_1), "
        "lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, "
        'rhs_contracting_dims={1}, backend_config={"sizes":["16"],"x":{"y":"}"}}'
    )
    assert dot is not None
    assert dot.dims("lhs_contracting_dims") == [2] and dot.dims("rhs_batch_dims") == [0]
    assert dot.operand_precision == [] and dot.window == {}
    assert dot.backend_config == {"sizes": ["16"], "x": {"y": "}"}}
    assert _compiler.array_type("bf16[8,128]{1,0:T(8,128)(2,1)}") == ("bf16", [8, 128])
    assert _compiler.array_type("(f32[2], s32[])") is None
    assert _compiler.arrays("f32[8]{0:T(256)S(1)}") == [
        _compiler.Array(32, False, True)
    ]


def test_hlo_fixture_traffic():
    text = fixture("tpu_hlo.txt")
    inputs = [("params", "stack"), ("batch", "x")]
    rows = _compiled_traffic.count(_costs.Program(text, "tpu"), inputs, [], ())
    # One layer of the host-resident stack to the device in each of the 3 trips.
    layer = 128 * 128 * 4
    assert rows == (
        Transfer("host_to_device", "forward/backward", "params", "stack", 3 * layer),
    )


def _structure(text: str) -> dict:
    """What the parser reads of a module, without the debug information (which
    names lines of `capture.py`)."""
    module = _compiler.parse_hlo(text)
    return {
        "entry": module.entry,
        "computations": {
            c.name: (
                c.root,
                c.params,
                [(i.name, i.shape, i.opcode, i.operands) for i in c.insts.values()],
            )
            for c in module.computations.values()
        },
    }


def test_this_libtpu_compiles_as_the_fixtures_say():
    pytest.importorskip("libtpu")
    live = capture.tpu_hlo()
    assert _structure(live) == _structure(fixture("tpu_hlo.txt"))
    assert _compiler.op_names(live) == _compiler.op_names(fixture("tpu_hlo.txt"))
    assert capture.tpu_out_of_memory() == fixture("tpu_out_of_memory.txt")


def test_crash_line_is_the_failed_check():
    """libtpu 0.0.42's abort compiling with its remat to host (`plan`, 65-layer GPT):
    the failed check, not the signal handler's last words; else the last line."""
    stderr = (
        "WARNING: All log messages before absl::InitializeLog() is called ...\n"
        "F1125 22:21:07.664641   17721 hlo_rematerialization.cc:2116] Check failed: "
        "!place_before_list.empty() Have nothing to place this before!\n"
        "*** SIGABRT received by PID 17721 (TID 17721) on cpu 1 ***\n"
        "E1125 22:21:07.705482   17721 process_state.cc:708] RAW: Raising signal 6\n\n"
    )
    assert _compiler.crash_line(stderr).endswith(
        "Check failed: !place_before_list.empty() Have nothing to place this before!"
    )
    assert _compiler.crash_line("a\nKilled\n") == "Killed"
    assert _compiler.crash_line("") == ""
