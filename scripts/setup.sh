#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs pagoda into it.
#
# torch comes first, chosen by the machine: without an NVIDIA GPU the CPU build
# (torch==2.13.0, which these machines keep on local disk), never the multi-GB CUDA
# wheels; with one, the CUDA build from PyPI. Override with PAGODA_TORCH_SPEC
# (e.g. "torch==2.13.0") and PAGODA_TORCH_INDEX_URL (e.g. PyTorch's cu128 index).
# A second run with nothing changed returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

python_bin=${PYTHON:-python3}
venv=.venv
if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating $venv" >&2
    "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

stamp_file="$venv/.setup-stamp"
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
    && "$venv/bin/python" -c "import torch, pagoda" 2>/dev/null; then
    exit 0
fi

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if [ -n "${PAGODA_TORCH_SPEC:-}" ]; then
        spec=$PAGODA_TORCH_SPEC
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        spec="torch>=2.6"
        echo "setup: NVIDIA GPU found, installing a CUDA build of torch" >&2
    else
        spec="torch==2.13.0"
        echo "setup: no GPU, installing the CPU build $spec" >&2
    fi
    index=()
    [ -n "${PAGODA_TORCH_INDEX_URL:-}" ] && index=(--index-url "$PAGODA_TORCH_INDEX_URL")
    "${pip[@]}" install "${index[@]}" "$spec"
fi

echo "setup: installing pagoda and its dependencies" >&2
"${pip[@]}" install -e '.[test]'
echo "$stamp" > "$stamp_file"
