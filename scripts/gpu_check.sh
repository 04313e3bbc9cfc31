#!/usr/bin/env bash
# The GPU check: one command that proves and measures the GPU path (about 8 minutes on an
# H200) and writes one JSON report, whose path it prints last. The parts (a random 1 B
# model, the Triton kernel tests compiled on the GPU, engine-vs-HF exactness on CUDA, the
# decode-step profile, the offline and --launch benchmarks, the kernel bench), each with
# its own timeout, are in pagoda/bench/gpu_check.py.
#
#   bash scripts/gpu_check.sh                    # on a GPU machine
#   bash scripts/gpu_check.sh --dry-run          # anywhere: the same parts on the CPU, toy sizes
#   bash scripts/gpu_check.sh --report PATH --parts exactness,step_profile --budget-s 300
#   bash scripts/gpu_check.sh --prepare [DIR]    # where a package index is reachable: fill
#                                                # DIR (default .gpu) for a machine without one
#
# Python: $PYTHON, else .venv/bin/python where it exists, else python3 (on the GPU
# machines, the image's python3 with a CUDA torch, Triton and transformers). pagoda runs
# from this checkout (on PYTHONPATH), not installed. What a machine lacks comes from the
# carried folder $PAGODA_GPU_CARRY (default .gpu, git-ignored), which --prepare fills:
#   wheels/     the packages pagoda imports that the GPU image lacks (pyzmq, msgspec,
#               fastapi and its stack, uvicorn), the versions this checkout's .venv runs,
#               for CPython $PAGODA_GPU_PYTHON_VERSION (default 3.12) on manylinux x86-64;
#               installed with --no-index into a private folder put on PYTHONPATH, and only
#               when one of them does not import
#   tokenizer/  SmolLM2's tokenizer files, so the random model takes text prompts
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${PYTHON:-}" ]; then
    py=$PYTHON
elif [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
fi
carry=${PAGODA_GPU_CARRY:-.gpu}
# the distributions pagoda imports (pyproject.toml) that the GPU image lacks, with what
# they need beyond it (.library/device/KINDS.md lists the image's packages); xgrammar
# (structured output) is left out: the check sends no grammar
wheels=(pyzmq msgspec fastapi starlette pydantic pydantic-core annotated-types
        typing-inspection typing-extensions annotated-doc uvicorn opentelemetry-api anyio sniffio)
imports="import zmq, msgspec, fastapi, starlette, pydantic, uvicorn"

prepare() {
    local dir=${1:-$carry}
    mkdir -p "$dir/wheels" "$dir/tokenizer"
    local pins
    pins=$("$py" -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${wheels[@]}")
    echo "gpu_check: downloading $pins" >&2
    # one version of each (two stop the install there); --no-deps: the list is complete
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: \
        --python-version "${PAGODA_GPU_PYTHON_VERSION:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dir/wheels" $pins
    local tok
    tok=$("$py" -c 'from pagoda.model_fetch import resolve_model; print(resolve_model("smollm2"))')
    for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
        if [ -f "$tok/$f" ]; then cp "$tok/$f" "$dir/tokenizer/"; fi
    done
    du -sh "$dir"
    echo "gpu_check: carry $dir to the GPU machine and run bash scripts/gpu_check.sh there" >&2
}

if [ "${1:-}" = "--prepare" ]; then
    prepare "${2:-}"
    exit 0
fi

setup="nothing to install"
if ! "$py" -c "$imports" 2>/dev/null; then
    site=${PAGODA_GPU_SITE:-/tmp/pagoda-gpu-site}
    if compgen -G "$carry/wheels/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$carry"/wheels/*.whl
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        setup="installed $(compgen -G "$carry/wheels/*.whl" | wc -l) wheels from $carry/wheels into $site"
    else
        setup="packages missing and no wheels in $carry/wheels (run --prepare where pip reaches an index)"
    fi
    if ! "$py" -c "$imports" 2>/dev/null; then
        setup="$setup; still not importable: $imports"
    fi
fi
echo "gpu_check: $py, $setup" >&2
export PAGODA_GPU_CHECK_SETUP="$setup"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m pagoda.bench.gpu_check --carry "$carry" "$@"
