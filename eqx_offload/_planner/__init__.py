"""Automatic planning: the fastest placement of a training step that fits a device
and a host memory budget.

`_candidates` describes what is chosen between: a placement per top-level field
and per part of its optimizer state (a `Part`), a choice per checkpoint name, and
the moves between them. `_sizes` weighs those parts before compiling, `_budget`
reads budgets and the device memory left free, `_table` shows the candidates and
`_rates` what each estimate rests on. `_compile` compiles one candidate (and keeps
what it compiled), `_search` searches the candidates, `_choice` is how the choice
among those that fit is made within the estimates' error (and which stages are
experimental), and `_outcome` makes it, with the table or the error when nothing
fits. `_arguments` checks `plan`'s arguments, `_plan` is `plan` and the order of
its search, `_plan_type` its result (`Plan`, `PlanInterrupted`); `_fewest` plans
the targets of a chip kind for the fewest devices (`fewest_chips`).
"""

from ._fewest import fewest_chips as fewest_chips
from ._plan import plan as plan
from ._plan_type import Plan as Plan, PlanInterrupted as PlanInterrupted
from ._table import PlanRow as PlanRow, PlanTable as PlanTable
