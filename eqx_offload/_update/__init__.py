"""The optimizer update: where optimizer state lives, and how the update runs.

The update runs whole, or streamed: one layer or row block of the parameters on the
device at a time.

- `_optim` places the state; `_dispatch` runs the update whole, streamed or on the host.
- `_state_tree` pairs state leaves with the parameters they mirror.
- `_jaxpr_dataflow` (an adapter, at the top level) reads the update's jaxpr: which
  values are shared, piecewise or global.
- `_streaming` runs it piece by piece. `_piece_loop` is the loop over one group.
- `_host` runs it on the host's CPU.
- `_optimizer_update` is the public update for a hand-written step.
"""

from ._apply_pending import apply_pending as apply_pending
from ._deferred import (
    apply_waiting as apply_waiting,
    hold_update as hold_update,
    layer_updates as layer_updates,
    own_state as own_state,
)
from ._dispatch import (
    is_trainable as is_trainable,
    param_kinds as param_kinds,
    trainable as trainable,
    update as update,
    UpdateArgs as UpdateArgs,
    with_params as with_params,
)
from ._host import NotOnHost as NotOnHost
from ._optim import (
    as_transformation as as_transformation,
    check_step as check_step,
    init_opt_state as init_opt_state,
    place_opt_state as place_opt_state,
    place_state as place_state,
    stepping as stepping,
    streamed_leaves as streamed_leaves,
)
from ._optimizer_update import optimizer_update as optimizer_update
from ._state_tree import check_matches as check_matches, state_leaves as state_leaves
