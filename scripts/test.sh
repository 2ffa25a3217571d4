#!/usr/bin/env bash
# The one test command: creates .venv if missing, installs the project with its test
# extras, then runs ruff, pyright, the docs site build and pytest (in two
# processes). `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv test

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== pyright"
.venv/bin/pyright
echo "== docs site (mkdocs build --strict)"
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
echo "== pytest"
# Two processes (one per core of CI's two), each taking whole files, slowest first
# (`tests/conftest.py`): one process leaves a core idle. `-n 0` runs in this one.
.venv/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
