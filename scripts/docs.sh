#!/usr/bin/env bash
# Builds the documentation site into site/ (`bash scripts/docs.sh serve` serves it
# at http://127.0.0.1:8000 instead). Creates .venv with the docs extra if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv docs
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = "serve" ]; then
    exec .venv/bin/mkdocs serve
fi
.venv/bin/mkdocs build --strict  # (not --quiet: it hides the warnings --strict fails on)
echo "built site/index.html"
