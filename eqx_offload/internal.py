"""Internals for eqx_offload's own tests and benchmarks, as `equinox.internal` is
for Equinox's tests.

Nothing here is public API, and nothing here has a stability guarantee: any name
may change or go without notice. The tests and benchmarks reach below the public
API only through the names this module re-exports (`import eqx_offload.internal as
eoi`), so that the private modules can be rearranged in one place; it re-exports
names, never whole modules. Two exceptions: a test that patches a module's global
names it by its dotted path (`monkeypatch.setattr("eqx_offload._tiling.PIECE_BYTES",
...)`: the patch must reach the module that reads it), and the adapters' own tests
(`tests/test_jaxpr_adapter.py`, `test_private_jax_api.py`, `test_compiler_text.py`)
import the adapter they test. `tests/test_structure.py` holds both to that.
"""

from ._checkpoint_name_log import is_inside as is_inside, UnusedName as UnusedName
from ._compat import (
    host_forms as host_forms,
    named_sharding as named_sharding,
    on_host as on_host,
)
from ._compiler import (
    array_type as array_type,
    arrays as hlo_arrays,
    compile_options as compile_options,
    Computation as Computation,
    has_host_compute as has_host_compute,
    Instruction as Instruction,
    JAX_VERSION as JAX_VERSION,
    parse_hlo as parse_hlo,
    Phase as Phase,
    phase as hlo_phase,
    tuple_elements as tuple_elements,
)
from ._cutting import (
    batch_sizes as batch_sizes,
    cut as cutting_cut,
    examples as cutting_examples,
    model_sizes as model_sizes,
    state_sizes as state_sizes,
)
from ._diagnose import (
    _probe as diagnose_probe,
    rejected as diagnose_rejected,
    Streamed as Streamed,
)
from ._jaxpr import (
    cond_branches as cond_branches,
    is_cond as is_cond,
    is_scan as is_scan,
    primitive_name as primitive_name,
    scan_layout as scan_layout,
    sub_jaxprs as sub_jaxprs,
)
from ._jaxpr_flops import matmul_flops as matmul_flops
from ._memory_kinds import (
    abstract as abstract_tree,
    is_arraylike as is_arraylike,
    is_host as is_host,
    is_masked as is_masked,
    kind_of as kind_of,
)
from ._microbatch import split as microbatch_split
from ._mixed_precision import (
    compute_dtypes as compute_dtypes,
    ComputeCopyState as ComputeCopyState,
    for_policy as for_policy,
    sources as compute_sources,
)
from ._paths import (
    join as paths_join,
    leaves as paths_leaves,
    matches as paths_matches,
    prefix_match as prefix_match,
)
from ._pending import owed as pending_owed, Record as Record, take as pending_take
from ._planner._arguments import (
    budgets as planner_budgets,
    capacity as planner_capacity,
    searched as searched_counts,
)
from ._planner._budget import parse_bytes as parse_bytes
from ._planner._candidates import (
    Candidate as Candidate,
    Move as Move,
    Part as Part,
    presets as presets,
    Settings as Settings,
)
from ._planner._choice import (
    choose as choose,
    Experimental as Experimental,
    experimental_names as experimental_names,
    Option as Option,
    tied as tied,
)
from ._planner._compile import (
    _child as compile_child,
    report as compile_report,
    report_in_child as report_in_child,
    Task as Task,
)
from ._planner._fewest import _none_fits as none_fits, _why as planner_fewest_why
from ._planner._plan import (
    _start as plan_start,
    AGAIN as AGAIN,
    search_plan as search_plan,
)
from ._planner._search import (
    COMBINATION_COMPILES as COMBINATION_COMPILES,
    IMPROVE_COMPILES as IMPROVE_COMPILES,
    Search as Search,
)
from ._planner._sizes import tables_of as tables_of, trainable as sizes_trainable
from ._policy import replace as replace_policy, split_names as split_names
from ._prefetch import _scan as prefetch_scan
from ._report import saved_for_backward as saved_for_backward
from ._report._compiled_traffic import count as compiled_traffic_count
from ._report._costs import (
    host_temporaries as host_temporaries,
    precision as costs_precision,
)
from ._report._does_not_fit import device_advice as device_advice, Held as Held
from ._report._hardware import (
    H200_FITTED as H200_FITTED,
    H200_MEASURED as H200_MEASURED,
)
from ._report._hlo_program import moved as hlo_moved, Walker as Walker
from ._report._memory_report import _check_host_kept as check_host_kept
from ._report._plot import categories as plot_categories
from ._report._step_time import (
    ATTENTION_NOTE as ATTENTION_NOTE,
    estimate as step_time_estimate,
    lines as step_time_lines,
    Program as Program,
)
from ._report._targets import (
    capacity as targets_capacity,
    chip_mesh as chip_mesh,
    chips_per_host as chips_per_host,
    device_count as device_count,
    devices as targets_devices,
    HBM_BYTES as HBM_BYTES,
    host_memory as host_memory,
    parse as targets_parse,
    platform as targets_platform,
    slice_mesh as slice_mesh,
    target_sizes as target_sizes,
    where_of as memory_report_where,
)
from ._report._traffic import Transfer as Transfer
from ._report._units import time_text as time_text
from ._residuals import (
    checkpoint_names as jaxpr_checkpoint_names,
    saved_residuals as saved_residuals,
)
from ._scan_body import to_device as to_device
from ._scopes import COPIES as COPIES
from ._state_dict import layer_axes as layer_axes
from ._tiling import (
    row_blocks as row_blocks,
    slices_by_layer as slices_by_layer,
    WHOLE_ON as WHOLE_ON,
)
from ._train_step import (
    _mesh_shardings as mesh_shardings,
    flat_arguments as flat_arguments,
)
from ._update import (
    own_state as own_state,
    state_leaves as state_leaves,
    trainable as trainable,
)
from ._update._streaming import (
    NotStreamable as NotStreamable,
    pieces as streaming_pieces,
    update as streaming_update,
)
from ._verify import _reference as verify_reference
