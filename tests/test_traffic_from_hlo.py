# ruff: noqa: E501  (the HLO text below keeps the compiler's long lines)
"""Reading host <-> device traffic from a compiled module's HLO text: transfers
into and out of memory space 5, times the trip counts of the loops around them,
attributed to the step's arguments."""

import eqx_offload.internal as eoi
from eqx_offload.internal import Transfer


# A loop of 3 trips that reads one layer of a host-resident stack (parameter 0)
# asynchronously and writes one row into a host-resident buffer (parameter 1),
# and a whole copy of parameter 2 to the device in the optimizer update.
HLO = """HloModule jit__step, is_scheduled=true

%async_computation (param_0.1: f32[3,8,128], param_1.1: s32[]) -> f32[1,8,128] {
  %param_0.1 = f32[3,8,128]{2,1,0:T(8,128)S(5)} parameter(0)
  %param_1.1 = s32[]{:T(128)} parameter(1)
  %constant.9 = s32[]{:T(128)} constant(0)
  ROOT %dynamic-slice.1 = f32[1,8,128]{2,1,0:T(8,128)} dynamic-slice(%param_0.1, %param_1.1, %constant.9, %constant.9), dynamic_slice_sizes={1,8,128}, metadata={op_name="jit(_step)/jvp(vmap())/while/body/dynamic_slice"}
}

%cond (arg.1: (s32[], f32[3,8,128], f32[3,128])) -> pred[] {
  %arg.1 = (s32[]{:T(128)}, f32[3,8,128]{2,1,0:T(8,128)S(5)}, f32[3,128]{1,0:T(8,128)S(5)}) parameter(0)
  %constant.3 = s32[]{:T(128)} constant(3)
  %gte.1 = s32[]{:T(128)} get-tuple-element(%arg.1), index=0
  ROOT %lt.1 = pred[]{:T(512)} compare(%gte.1, %constant.3), direction=LT
}

%body (arg.2: (s32[], f32[3,8,128], f32[3,128])) -> (s32[], f32[3,8,128], f32[3,128]) {
  %arg.2 = (s32[]{:T(128)}, f32[3,8,128]{2,1,0:T(8,128)S(5)}, f32[3,128]{1,0:T(8,128)S(5)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%arg.2), index=0
  %stack = f32[3,8,128]{2,1,0:T(8,128)S(5)} get-tuple-element(%arg.2), index=1
  %buffer = f32[3,128]{1,0:T(8,128)S(5)} get-tuple-element(%arg.2), index=2
  %start.1 = ((f32[3,8,128]{2,1,0:T(8,128)S(5)}, s32[]{:T(128)}), f32[1,8,128]{2,1,0:T(8,128)}, u32[]{:S(2)}) async-start(%stack, %i), calls=%async_computation
  %done.1 = f32[1,8,128]{2,1,0:T(8,128)} async-done(%start.1), calls=%async_computation
  %row = f32[1,128]{1,0:T(8,128)} slice(%done.1), slice={[0:1], [0:1], [0:128]}
  %zero = s32[]{:T(128)} constant(0)
  %written = f32[3,128]{1,0:T(8,128)S(5)} dynamic-update-slice(%buffer, %row, %i, %zero), metadata={op_name="jit(_step)/transpose(jvp(vmap()))/while/body/dynamic_update_slice"}
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  ROOT %tuple.2 = (s32[]{:T(128)}, f32[3,8,128]{2,1,0:T(8,128)S(5)}, f32[3,128]{1,0:T(8,128)S(5)}) tuple(%next, %stack, %written)
}

ENTRY %main.1 (p0: f32[3,8,128], p1: f32[3,128], p2: f32[16,128]) -> (f32[3,128], f32[16,128]) {
  %p0 = f32[3,8,128]{2,1,0:T(8,128)S(5)} parameter(0), metadata={op_name="model_dynamic[0]"}
  %p1 = f32[3,128]{1,0:T(8,128)S(5)} parameter(1), metadata={op_name="model_dynamic[1]"}
  %p2 = f32[16,128]{1,0:T(8,128)S(5)} parameter(2), metadata={op_name="opt_dynamic[0]"}
  %c0 = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, f32[3,8,128]{2,1,0:T(8,128)S(5)}, f32[3,128]{1,0:T(8,128)S(5)}) tuple(%c0, %p0, %p1)
  %loop = (s32[]{:T(128)}, f32[3,8,128]{2,1,0:T(8,128)S(5)}, f32[3,128]{1,0:T(8,128)S(5)}) while(%init), condition=%cond, body=%body
  %out = f32[3,128]{1,0:T(8,128)S(5)} get-tuple-element(%loop), index=2
  %cs = (f32[16,128]{1,0:T(8,128)}, f32[16,128]{1,0:T(8,128)S(5)}, u32[]{:S(2)}) copy-start(%p2), metadata={op_name="jit(_step)/optimizer_update/copy"}
  %cd = f32[16,128]{1,0:T(8,128)} copy-done(%cs)
  %back = f32[16,128]{1,0:T(8,128)S(5)} copy(%cd), metadata={op_name="jit(_step)/optimizer_update/opt_state/copy"}
  ROOT %result = (f32[3,128]{1,0:T(8,128)S(5)}, f32[16,128]{1,0:T(8,128)S(5)}) tuple(%out, %back)
}
"""


def test_counts_loops_and_follows_values_to_arguments():
    inputs = [("params", "blocks.weight"), ("params", "rows"), ("opt_state", "mu")]
    outputs = [("params", "rows"), ("opt_state", "mu")]
    rows = eoi.compiled_traffic_count(eoi.Program(HLO, "tpu"), inputs, outputs, ())
    layer, row, whole = 8 * 128 * 4, 128 * 4, 16 * 128 * 4
    assert set(rows) == {
        # three asynchronous layer reads, followed through the loop to parameter 0
        Transfer(
            "host_to_device", "forward/backward", "params", "blocks.weight", 3 * layer
        ),
        # three row writes into the loop's buffer, which starts as parameter 1
        Transfer("device_to_host", "forward/backward", "params", "rows", 3 * row),
        # a whole copy in the update, and the new value written back as output 1
        Transfer("host_to_device", "update", "opt_state", "mu", whole),
        Transfer("device_to_host", "update", "opt_state", "mu", whole),
    }


def test_trip_count_from_the_condition_or_the_known_count():
    comps, entry = eoi.parse_hlo(HLO)
    walker = eoi.Walker(comps, entry)
    times = {comp.name: n for comp, n in walker.visits()}
    assert times["body"] == 3 and times["async_computation"] == 3
    known = HLO.replace(
        "condition=%cond, body=%body",
        'condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}',
    )
    comps, entry = eoi.parse_hlo(known)
    times = {c.name: n for c, n in eoi.Walker(comps, entry).visits()}
    assert times["body"] == 5
