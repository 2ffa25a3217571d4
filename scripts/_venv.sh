# Sourced by the scripts: `ensure_venv EXTRA` creates .venv with the interpreter in
# $PYTHON (default python3) if it is missing, and installs `.[EXTRA]` into it when
# pyproject.toml changed since the last install. It installs with uv (from PyPI, into
# the venv first), which fetches and unpacks in parallel: the test extras take about
# 20 s instead of pip's 45 s on a new machine. Where uv cannot be installed, pip does
# the same.
ensure_venv() {
    local extra="$1" python="${PYTHON:-python3}" stamp=".venv/.installed-$1"
    if [ ! -x .venv/bin/python ]; then
        echo "== creating .venv with $("$python" --version)"
        "$python" -m venv .venv
        .venv/bin/python -m pip install --quiet --disable-pip-version-check uv ||
            echo "(uv did not install: installing with pip)"
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "== installing .[$extra] into .venv"
        if [ -x .venv/bin/uv ]; then
            .venv/bin/uv pip install --quiet --python .venv/bin/python -e ".[$extra]"
        else
            .venv/bin/python -m pip install --quiet --upgrade pip
            .venv/bin/python -m pip install --quiet -e ".[$extra]"
        fi
        touch "$stamp"
    fi
}
