"""Declarative host offloading for JAX + Equinox.

Equinox modules carry memory-kind annotations on their leaves, `Stacked` layers are
scanned one at a time, and `filter_offload`/`train_step` insert the checkpoint
names, remat policy and `device_put` transfers that are otherwise written by hand.
"""

import importlib.metadata

from ._checkpoint_names import (
    checkpoint_names as checkpoint_names,
    CheckpointName as CheckpointName,
)
from ._cross_entropy import chunked_cross_entropy as chunked_cross_entropy
from ._custom_types import MemoryKind as MemoryKind
from ._diagnose import DoesNotCompile as DoesNotCompile
from ._embedding import embed as embed
from ._layout import FSDP as FSDP
from ._loading import (
    load as load,
    Restored as Restored,
    RestoredWithExtra as RestoredWithExtra,
)
from ._mixed_precision import ComputeCopyState as ComputeCopyState
from ._pending import PendingUpdate as PendingUpdate
from ._placement import field as field, place as place
from ._planner import (
    fewest_chips as fewest_chips,
    Plan as Plan,
    plan as plan,
    PlanInterrupted as PlanInterrupted,
    PlanRow as PlanRow,
    PlanTable as PlanTable,
)
from ._policy import Policy as Policy
from ._policy_args import ExperimentalWarning as ExperimentalWarning
from ._report import (
    DoesNotFit as DoesNotFit,
    Hardware as Hardware,
    memory_report as memory_report,
    MemoryReport as MemoryReport,
    ResidualRow as ResidualRow,
    StepTime as StepTime,
    Transfer as Transfer,
    UnnamedResidual as UnnamedResidual,
)
from ._saving import (
    save as save,
    saved_steps as saved_steps,
    Saving as Saving,
    wait_until_finished as wait_until_finished,
)
from ._stacked import Stacked as Stacked
from ._state_dict import (
    LeafIndex as LeafIndex,
    load_state_dict as load_state_dict,
    state_dict as state_dict,
    state_dict_key as state_dict_key,
    state_dict_keys as state_dict_keys,
)
from ._train_step import train_step as train_step, TrainStep as TrainStep
from ._transform import filter_offload as filter_offload
from ._update import (
    apply_pending as apply_pending,
    init_opt_state as init_opt_state,
    optimizer_update as optimizer_update,
    place_opt_state as place_opt_state,
)
from ._verify import verify as verify
from ._verify_report import (
    Difference as Difference,
    DoesNotMatch as DoesNotMatch,
    VerifyReport as VerifyReport,
)


__version__ = importlib.metadata.version("eqx_offload")
