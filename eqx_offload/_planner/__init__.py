"""Automatic planning: the fastest placement of a training step that fits a device
and a host memory budget.

`_candidates` describes what is chosen between: a placement per top-level field
and per part of its optimizer state (a `Part`), a choice per checkpoint name, and
the moves between them. `_sizes` weighs those parts before compiling, `_budget`
reads budgets, `_table` shows the candidates. `_compile` compiles one candidate
(and keeps what it compiled), `_search` chooses between the compiled candidates.
`_plan` is `plan` and its result (`Plan`); `_fewest` plans the targets of a chip
kind for the fewest devices (`fewest_chips`).
"""

from ._fewest import fewest_chips as fewest_chips
from ._plan import Plan as Plan, plan as plan
from ._table import PlanRow as PlanRow, PlanTable as PlanTable
