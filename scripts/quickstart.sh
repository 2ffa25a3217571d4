#!/usr/bin/env bash
# The main job: creates .venv if missing, installs the project, and trains the
# quickstart model on built-in synthetic data, printing where memory lives.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv examples
# The CPU unless told otherwise: with libtpu installed (the `tpu` extra, which the
# tests install into the same .venv), JAX would otherwise probe for TPU hardware.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec .venv/bin/python examples/quickstart.py "$@"
