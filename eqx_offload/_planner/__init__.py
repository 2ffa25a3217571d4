"""Automatic planning: the fastest placement of a training step that fits a device
and a host memory budget.

`_candidates` describes what is chosen between (placements per top-level field,
a choice per checkpoint name) and the moves between them, `_budget` reads
budgets, and `_plan` compiles candidates and chooses (`plan`, `Plan`).
"""

from ._plan import (
    Plan as Plan,
    plan as plan,
    PlanRow as PlanRow,
    PlanTable as PlanTable,
)
