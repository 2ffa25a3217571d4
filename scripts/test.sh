#!/usr/bin/env bash
# The one test command: creates .venv if missing, installs the project with its test
# extras, then runs ruff, the docs site build and pytest (in two processes), with
# pyright beside them (it fills the cores pytest leaves idle). Any failure fails
# the run. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv test

echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== pyright (in the background, beside the docs build and pytest; waited for last)"
pyright_log=$(mktemp)
.venv/bin/pyright >"$pyright_log" 2>&1 &
pyright_pid=$!
echo "== docs site (mkdocs build --strict, nothing printed but its progress)"
# Not `--quiet`: it hides the warnings from `--strict` too, which then passes with
# them. Any line but the build's three lines of progress fails the run.
docs_log=$(NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict 2>&1) || {
    echo "$docs_log"
    exit 1
}
progress='^INFO +- +(Cleaning site directory|Building documentation to directory: |Documentation built in )'
if grep -Ev "$progress" <<<"$docs_log" | grep -q .; then
    echo "$docs_log"
    echo "the docs site build printed more than its progress (above)"
    exit 1
fi
echo "== pytest"
# Two processes (one per core of CI's two), each taking whole files, slowest first
# (`tests/conftest.py`): one process leaves a core idle. `-n 0` runs in this one.
pytest_rc=0
.venv/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@" || pytest_rc=$?
echo "== pyright's result"
pyright_rc=0
wait "$pyright_pid" || pyright_rc=$?
tail -n 1 "$pyright_log"
if [ "$pyright_rc" -ne 0 ]; then
    cat "$pyright_log"
    echo "pyright failed (above)"
fi
rm -f "$pyright_log"
exit $((pytest_rc != 0 ? pytest_rc : pyright_rc))
