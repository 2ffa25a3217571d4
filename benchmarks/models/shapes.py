"""The public model shapes the benchmarks compile (`decoder.Shape`), and the batch
most of them train on: 8 sequences of 1024 tokens (`at_scale.py`: 4096-token
sequences, many per update)."""

from models.decoder import Shape


# Llama 3.2 1B: RMSNorm, grouped-query attention with RoPE, SwiGLU, a tied table.
LLAMA_3_2_1B = Shape(
    vocab=128256,
    dim=2048,
    layers=16,
    heads=32,
    kv_heads=8,
    head_dim=64,
    mlp=8192,
    tied=True,
)
# On one GPU (`gpu_models.py`, `fewest.py`, `host_update.py`).
GPU_MODELS = {
    "GPT-2 XL": Shape(
        vocab=50257,
        dim=1600,
        layers=48,
        heads=25,
        kv_heads=25,
        head_dim=64,
        mlp=6400,
        tied=True,
        style="gpt2",
        positions=1024,
    ),
    "Mistral-7B-shaped": Shape(
        vocab=32000,
        dim=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        mlp=14336,
        tied=False,
        rope_base=1e6,
    ),
}
BATCH, SEQ = 8, 1024
# Llama 3 8B: the Mistral-7B shape's blocks, a vocabulary of 128256 and RoPE base
# 500000 (`at_scale.py`, `gpu_check.py`; `examples/finetune_8b.py` writes the same
# shape out itself).
LLAMA_3_8B = GPU_MODELS["Mistral-7B-shaped"]._replace(vocab=128256, rope_base=500000.0)
