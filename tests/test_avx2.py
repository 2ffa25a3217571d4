"""The comparisons with a plain JAX/Equinox reference pass on an x86-64 CPU without
AVX-512 too. The instruction set changes float32 results (design notes, "JAX facts
relied on": after 10 AdamW steps one element of 1024 differed by 1.2e-5 relative
between an AVX-512 machine and an AVX2 one), so a representative few of them run
again here in a child process whose XLA compiles for AVX2 at most
(`--xla_cpu_max_isa=AVX2`) and whose oneDNN kernels (XLA's CPU matmuls, chosen at
run time by what the CPU has) are AVX2's (`ONEDNN_MAX_CPU_ISA=AVX2`): a result that
the caps move past a tolerance fails on an AVX-512 machine too. (Under
`tests/conftest.py`'s flags the XLA cap alone gave AVX-512's very bits on the
machine the tolerances were measured on; the oneDNN cap changes them, as an AVX2
machine's kernels do: see the test suite in `docs/design-notes.md`.)"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent

# After several optimizer steps, against a reference: AdamW with an L2 penalty in
# each preset and the negative control that must fail them, AdamW with
# micro-batches, AdamW with bf16 compute and fp32 masters.
COMPARISONS = [
    "tests/test_train_step.py::test_matches_reference_with_l2_penalty",
    "tests/test_train_step.py::test_a_learning_rate_off_by_a_thousandth_is_caught",
    "tests/test_microbatch.py::test_adamw_state_and_parameters_follow_the_whole_batch",
    "tests/test_mixed_precision.py::test_master_equals_the_same_scheme_by_hand",
]


@pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="`--xla_cpu_max_isa=AVX2` names an x86-64 instruction set",
)
def test_reference_comparisons_pass_on_avx2():
    # `tests/conftest.py` has set its flags already; the child keeps them (and the
    # compilation cache, whose keys include the flags).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_max_isa=AVX2".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist"]
    command += ["-p", "no:cacheprovider", *COMPARISONS]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "skipped" not in output, output  # (a name not found fails the child)
