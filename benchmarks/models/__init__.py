"""The models the benchmark scripts compile: `gpt` (a GPT-style stack of MLP blocks),
`handwritten` (the same step written by hand in plain JAX), `decoder` (Llama- and
GPT-2-style decoders of any size), `shapes` (the public shapes they take),
`gpt_7b` (the 7.8B GPT of `slices.py` and `fewest.py`), `layers` (single layers
stacked by `checkpoint_memory.py` and `optimizer.py`) and `matrix` (the small models
of `compile_matrix.py`)."""
