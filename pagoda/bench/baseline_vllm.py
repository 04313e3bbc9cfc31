"""``--baseline vllm``: vLLM's CPU engine on the same requests, in the same run.

vLLM lives in its own environment (``.venv-vllm``, made by ``scripts/setup_vllm.sh``) and
runs as a subprocess over a workload file (``vllm_runner.py``); pagoda never imports it.
It gets both cores (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), a KV cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB, and tcmalloc and its bundled libiomp5 preloaded, as
vLLM's CPU docs ask. Without the environment the baseline is skipped with a message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagoda.bench.workload import Workload

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
RUNNER = Path(__file__).with_name("vllm_runner.py")
KV_CACHE_GIB = 4


def vllm_python() -> Path | None:
    python = VENV / "bin" / "python"
    return python if python.is_file() else None


def preloads() -> list[str]:
    """tcmalloc (the system's) and the libiomp5 intel-openmp put in the environment."""
    found = []
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 check=False).stdout
    except OSError:
        listing = ""
    for line in listing.splitlines():
        if "libtcmalloc_minimal.so.4 " in line and "=>" in line:
            found.append(line.split("=>")[1].strip())
            break
    found += [str(p) for p in sorted((VENV / "lib").glob("libiomp5.so"))][:1]
    return found


def run_vllm_baseline(model_dir: str, work: Workload, dtype: str, max_model_len: int,
                      bs1_prompt: list[int], bs1_output: int = 128,
                      timeout_s: float = 3600.0) -> dict[str, Any] | None:
    """vLLM's figures on ``work`` (see vllm_runner.py), or None when it is not installed."""
    python = vllm_python()
    if python is None:
        print(f"pagoda bench: --baseline vllm skipped: {VENV} is missing "
              f"(make it with: bash scripts/setup_vllm.sh)", file=sys.stderr)
        return None
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_TARGET_DEVICE": "cpu"}
    if libs := preloads():
        env["LD_PRELOAD"] = ":".join(libs + [env.get("LD_PRELOAD", "")]).rstrip(":")
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-") as tmp:
        workload, result = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        workload.write_text(json.dumps({
            "model": model_dir, "dtype": dtype, "max_model_len": max_model_len,
            "prompts": work.prompts, "output_lens": work.output_lens,
            "bs1_prompt": bs1_prompt, "bs1_output": bs1_output}))
        run = subprocess.run([str(python), str(RUNNER), str(workload), str(result)], env=env,
                             cwd=tmp, check=False, timeout=timeout_s, capture_output=True,
                             text=True)
        if run.returncode != 0:
            raise RuntimeError(f"vLLM baseline failed (exit {run.returncode}): "
                               f"{run.stderr[-3000:]}")
        figures: dict[str, Any] = json.loads(result.read_text())
    figures["ld_preload"] = env.get("LD_PRELOAD")
    return figures
