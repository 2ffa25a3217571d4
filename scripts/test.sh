#!/usr/bin/env bash
# The one test command: creates .venv if missing, installs the project with its test
# extras, then runs ruff, pyright and pytest. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv test

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== pyright"
.venv/bin/pyright
echo "== pytest"
.venv/bin/pytest -q "$@"
