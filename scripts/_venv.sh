# Sourced by the scripts: `ensure_venv EXTRA` creates .venv with the interpreter in
# $PYTHON (default python3) if it is missing, and installs `.[EXTRA]` into it when
# pyproject.toml changed since the last install. It installs with uv (from PyPI, into
# the venv first), which fetches and unpacks in parallel: the test extras take about
# 20 s instead of pip's 45 s on a new machine. Where uv cannot be installed, pip does
# the same. Both write the packages' bytecode at install (uv does not by default): a
# machine with PYTHONDONTWRITEBYTECODE set (CI's) would otherwise compile JAX's
# sources again in every test process, 25 s more of the suite for 9 s here.
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
            .venv/bin/uv pip install --quiet --compile-bytecode --python .venv/bin/python \
                -e ".[$extra]"
        else
            .venv/bin/python -m pip install --quiet --upgrade pip
            .venv/bin/python -m pip install --quiet -e ".[$extra]"
        fi
        touch "$stamp"
    fi
}
