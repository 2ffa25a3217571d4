"""Internals for eqx_offload's own tests and benchmarks, as `equinox.internal` is
for Equinox's tests.

Nothing here is public API, and nothing here has a stability guarantee: any name
may change or go without notice. The tests and benchmarks reach below the public
API only through this module (`import eqx_offload.internal as eoi`), so that the
private modules can be rearranged in one place. It only re-exports.

Modules are re-exported whole where a test reads or patches their globals
(`monkeypatch.setattr(eoi.tiling, "PIECE_BYTES", ...)`); single functions and
classes by name.
"""

from . import (
    _checkpoint_name_log as checkpoint_name_log,
    _compat as compat,
    _compiler as compiler,
    _compiler_thunks as compiler_thunks,
    _cutting as cutting,
    _diagnose as diagnose,
    _jaxpr as jaxpr,
    _loading as loading,
    _microbatch as microbatch,
    _paths as paths,
    _pending as pending,
    _placement as placement,
    _scan_body as scan_body,
    _tiling as tiling,
    _verify as verify,
)
from ._checkpoint_name_log import UnusedName as UnusedName
from ._memory_kinds import is_arraylike as is_arraylike, is_host as is_host
from ._planner import (
    _arguments as planner_arguments,
    _budget as planner_budget,
    _candidates as planner_candidates,
    _choice as planner_choice,
    _compile as planner_compile,
    _fewest as planner_fewest,
    _plan as planner_plan,
    _progress as planner_progress,
    _rates as planner_rates,
    _search as planner_search,
    _sizes as planner_sizes,
)
from ._policy import replace as replace_policy, split_names as split_names
from ._report import (
    _compiled_traffic as compiled_traffic,
    _costs as costs,
    _hardware as hardware,
    _hlo_program as hlo_program,
    _memory_report as memory_report,
    _minimum as minimum,
    _step_time as step_time,
    _targets as targets,
    saved_for_backward as saved_for_backward,
)
from ._report._does_not_fit import device_advice as device_advice
from ._report._plot import categories as plot_categories
from ._report._traffic import Transfer as Transfer
from ._report._units import time_text as time_text
from ._residuals import (
    checkpoint_names as jaxpr_checkpoint_names,
    saved_residuals as saved_residuals,
)
from ._state_dict import layer_axes as layer_axes
from ._train_step import (
    _mesh_shardings as mesh_shardings,
    flat_arguments as flat_arguments,
)
from ._update import _optim as optim, _streaming as streaming


__all__ = [
    # Modules, for the globals a test reads or patches.
    "checkpoint_name_log",
    "compat",
    "compiled_traffic",
    "compiler",
    "compiler_thunks",
    "costs",
    "hardware",
    "cutting",
    "diagnose",
    "hlo_program",
    "jaxpr",
    "loading",
    "memory_report",
    "microbatch",
    "minimum",
    "optim",
    "paths",
    "pending",
    "placement",
    "planner_arguments",
    "planner_budget",
    "planner_candidates",
    "planner_choice",
    "planner_compile",
    "planner_fewest",
    "planner_plan",
    "planner_progress",
    "planner_rates",
    "planner_search",
    "planner_sizes",
    "scan_body",
    "step_time",
    "streaming",
    "targets",
    "tiling",
    "verify",
    # Functions and classes.
    "device_advice",
    "flat_arguments",
    "is_arraylike",
    "is_host",
    "jaxpr_checkpoint_names",
    "layer_axes",
    "mesh_shardings",
    "plot_categories",
    "replace_policy",
    "saved_for_backward",
    "saved_residuals",
    "split_names",
    "time_text",
    "Transfer",
    "UnusedName",
]
