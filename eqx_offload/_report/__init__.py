"""Measuring and reporting: where each byte of a step lives, compiled for this
backend or a TPU or GPU target, and what moves between host and device.

`_memory_report` compiles the step (`_compile_job` holds what it compiles) and
builds the `MemoryReport`, which `_memory_report_type` defines and `_memory_table`
prints. `_saved_for_backward` measures what a step saves for its backward pass.
`_targets` makes the compile targets. `_traffic` names the transfers of the traced
program (`.._jaxpr_traffic` reads them), `_compiled_traffic` those of the compiler's
optimised program. `_plot` draws reports.
"""

from ._does_not_fit import DoesNotFit as DoesNotFit
from ._hardware import Hardware as Hardware
from ._memory_report import memory_report as memory_report
from ._memory_report_type import (
    MemoryReport as MemoryReport,
    ResidualRow as ResidualRow,
    UnnamedResidual as UnnamedResidual,
)
from ._saved_for_backward import saved_for_backward as saved_for_backward
from ._step_time import StepTime as StepTime
from ._traffic import Transfer as Transfer
from ._units import size_text as size_text, time_text as time_text
