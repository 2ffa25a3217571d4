"""The models the benchmark scripts compile: `gpt` (a GPT-style stack of MLP blocks),
`handwritten` (the same step written by hand in plain JAX), `decoder` (Llama- and
GPT-2-style decoders of any size), `shapes` (the public shapes they take) and
`matrix` (the small models of `compile_matrix.py`)."""
