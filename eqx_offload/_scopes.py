"""The named scopes a step writes around its values, read back by `memory_report`.

A transfer in a compiled program carries the named scope it was traced under.
The step writes these names (`_train_step.py`, `_update/`, the host-table reads);
the traffic readers (`_report/_traffic.py`, `_report/_compiled_traffic.py`) read them
to say what each transfer carries. Both sides import them from here, the bottom of the
import order.
"""

UPDATE = "optimizer_update"  # the whole optimizer update
PARAMS = "params"  # the new parameters, written back to their kinds
OPT_STATE = "opt_state"  # the new optimizer state, written back to its kinds
GRAD = "grad"  # gradients read by the update (`grad` or `grad.<path>`)
COPIES = "copies"  # the field of `ComputeCopyState` that holds compute copies
LAYERS = "stacked_layers"  # around each configured `Stacked`'s scan
# Around every read of a host table by blocks: the transform allows a host table to
# be used only under it.
VOCAB_BLOCKS = "eqx_offload_vocab_blocks"
