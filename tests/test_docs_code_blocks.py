"""Every ```python block of the README and the docs runs: the blocks of one page in
order, in one namespace, after the small model below (the `Model`, `loss_fn`,
`tokens`, ... the pages assume). Signatures and fragments are fenced as
```python title="... (not run)" and skipped. A ```text title="Output" fence right
after a block is what that block must print."""

import contextlib
import io
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\n", re.S | re.M)
OUTPUT = re.compile(r"\s*```text title=\"Output\"\n(.*?)^```", re.S | re.M)

PRELUDE = """
import equinox as eqx, jax, jax.numpy as jnp, optax
import eqx_offload as eo
from jax.sharding import NamedSharding, PartitionSpec as P


class MLP(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, dim, *, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(dim, 2 * dim, key=k1)
        self.fc2 = eqx.nn.Linear(2 * dim, dim, key=k2)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, dim, *, key):
        self.norm = eqx.nn.LayerNorm(dim)
        self.mlp = MLP(dim, key=key)

    def __call__(self, x, *, key=None):
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: eo.Stacked[Block]
    head: eqx.nn.Linear

    def __init__(self, *, key, vocab=64, dim=32, depth=2):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = eo.Stacked.from_fn(lambda k: Block(dim, key=k), depth, key=k2)
        self.head = eqx.nn.Linear(dim, vocab, key=k3)

    def __call__(self, tokens):
        return jax.vmap(self.head)(self.blocks(jax.vmap(self.embed)(tokens)))


class PerLayerModel(eqx.Module):  # the same model before its port to `Stacked`
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, *, key, vocab=64, dim=32, depth=2):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.blocks = [Block(dim, key=k) for k in jax.random.split(k2, depth)]
        self.head = eqx.nn.Linear(dim, vocab, key=k3)


def loss_fn(model, tokens, targets):
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


key = jax.random.key(0)
dim = 32
tokens = jax.random.randint(key, (8, 16), 0, 64)
targets = (tokens + 1) % 64
data = [(tokens, targets)] * 2
model = Model(key=key)
optimizer = optax.adamw(1e-3)
policy = eo.Policy.offload_all()
x = x0 = jnp.ones((16, dim))
xs = jnp.arange(24.0)  # one per layer of the 24-layer stack
block0, block1, block2 = (Block(dim, key=k) for k in jax.random.split(key, 3))
num_steps = 3


def get_batch(index, key):
    return tokens, targets
"""


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """The blocks to run: (line, code, the output it must print or `None`)."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if "not run" in m.group(1):
            continue
        printed = OUTPUT.match(text, m.end())
        line = text[: m.start()].count("\n") + 1
        out.append((line, m.group(2), printed.group(1) if printed else None))
    return out


def test_every_python_block_is_run_or_marked():
    """A python block is either run here or says it is not."""
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            info = match.group(1).strip()
            assert info == "" or "not run" in info, f"{page.name}: {info}"


@pytest.mark.parametrize(
    "page", [p for p in PAGES if blocks(p)], ids=lambda p: str(p.relative_to(ROOT))
)
def test_docs_code_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # checkpoints and files the blocks write
    namespace: dict = {"__name__": "docs"}
    exec(compile(PRELUDE, "prelude", "exec"), namespace)
    for line, code, expected in blocks(page):
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(compile("\n" * line + code, str(page), "exec"), namespace)
        if expected is not None:
            assert stdout.getvalue() == expected, f"{page.name}, line {line}"
