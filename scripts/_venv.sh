# Sourced by the scripts: `ensure_venv EXTRA` creates .venv with the interpreter in
# $PYTHON (default python3) if it is missing, and installs `.[EXTRA]` into it when
# pyproject.toml changed since the last install.
ensure_venv() {
    local extra="$1" python="${PYTHON:-python3}" stamp=".venv/.installed-$1"
    if [ ! -x .venv/bin/python ]; then
        echo "== creating .venv with $("$python" --version)"
        "$python" -m venv .venv
        .venv/bin/python -m pip install --quiet --upgrade pip
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "== installing .[$extra] into .venv"
        .venv/bin/python -m pip install --quiet -e ".[$extra]"
        touch "$stamp"
    fi
}
