"""The GPU check: one run that proves and measures the GPU path, and one JSON report.

    bash scripts/gpu_check.sh [--dry-run] [--parts a,b] [--budget-s S] [--report PATH]

(the script installs carried wheels where packages are missing, then runs
``python -m pagoda.bench.gpu_check``). Each part is a child process in a process group
of its own, with its own timeout (the group is killed when it runs over), so one hang
costs that part alone; a failed part is recorded and the next one runs, and parts left
when the overall budget is spent are recorded as not run. In order:

model          a random-weight 1.07 B Llama (``random_model --preset 1b``, bf16, SmolLM2's
               tokenizer when one is at hand)
kernel_tests   ``pytest tests/kernels`` compiled on the GPU (no TRITON_INTERPRET; the CPU
               C++ kernels' tests are left out)
exactness      ``pytest -m gpu tests/gpu tests/worker/test_cuda_graphs.py``: the engine
               against HF on CUDA, float32 greedy tokens and logits, bf16 error beside
               HF bf16 (each test's figures come back); the decode CUDA graphs captured
               and replayed against the eager path
step_profile   one decode step at batch 64, context 512 under torch.profiler
bench_offline  ``pagoda bench`` offline on the model, HF ``generate`` (bf16, static batch
               64) on the same GPU, and the roofline
bench_launch   ``pagoda bench --launch``: the same requests through a local stack (HTTP)
pipeline_ceiling  ``python -m pagoda.bench.pipeline_ceiling`` (HTTP, 2 frontends, 2 ms emulated
               steps): what the scheduler, frontends and wire carry on this host's cores
               at a GPU's pace, with each role's CPU microseconds per token
kernel_bench   ``python -m kernels.bench``: each Triton kernel per shape beside SDPA

``--dry-run`` runs the same parts on the CPU at toy sizes (a toy model, a handful of
requests, one kernel test file in Triton's interpreter; the gpu tests skip) to check the
check itself: about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("model", "kernel_tests", "exactness", "step_profile", "bench_offline", "bench_launch",
         "pipeline_ceiling", "kernel_bench")
MIN_PART_S = 20.0  # a part is not started with less of the budget left
TAIL_CHARS = 3000  # of each part's log, kept in the report
KILL_GRACE_S = 10.0


@dataclass
class Part:
    name: str
    argv: list[str]
    timeout_s: float
    figures: Callable[[], dict[str, Any]] | None = None  # read after the part ends
    env: dict[str, str] = field(default_factory=dict)
    needs_model: bool = True
    outputs: tuple[Path, ...] = ()  # files it writes: removed first, so none is stale


# -- figures each part leaves behind ---------------------------------------------------


def junit_counts(path: Path) -> dict[str, int]:
    """tests / passed / failed / errors / skipped of a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def kernel_bench_rows(log: Path) -> list[dict[str, Any]]:
    """The rows ``kernels.bench`` printed (kernel, shape, time, rate, peak fraction, ...)."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        t = line.split()
        if len(t) < 8 or line.startswith(("#", "kernel ")) or not t[-2].endswith("x"):
            continue
        try:
            rows.append({"kernel": t[0], "shape": " ".join(t[1:-6]), "us": float(t[-6]),
                         "rate": float(t[-5]), "unit": t[-4],
                         "peak_fraction": None if t[-3] == "-" else float(t[-3].rstrip("%")) / 100,
                         "speedup_vs_baseline": float(t[-2].rstrip("x")),
                         "max_diff": float(t[-1])})
        except ValueError:
            continue  # a log line that only looks like a row
    return rows


def bench_figures(path: Path) -> dict[str, Any]:
    """The headline figures of a ``pagoda bench --output-json`` report."""
    r = json.loads(path.read_text())
    p, cfg = r["pagoda"], r["config"]
    out: dict[str, Any] = {
        "engine_device": cfg.get("engine_device"), "engine_dtype": cfg.get("engine_dtype"),
        "num_requests": p["num_requests"], "num_completed": p["num_completed"],
        "output_tok_s": p["output_tok_s"], "total_tok_s": p["total_tok_s"],
        "ttft_p50_s": p["ttft_s"]["p50"], "tpot_p50_s": p["tpot_s"]["p50"],
    }
    hf = r.get("baseline_hf")
    if hf:
        out.update(hf_device=hf.get("device"), hf_best_output_tok_s=hf["best_output_tok_s"],
                   hf_best=f"{hf['best_dtype']} bs{hf['best_batch_size']}",
                   output_tok_s_vs_hf_best=(r.get("comparison") or {}).get(
                       "output_tok_s_ratio_vs_hf_best"))
    roof = r.get("roofline")
    if roof:
        out.update(roofline_fraction=roof.get("fraction"),
                   bs1_tpot_vs_weights_read=roof.get("bs1_tpot_vs_weights_read"))
    if p.get("bs1"):
        out["bs1_tpot_s"] = p["bs1"]["tpot_s"]
    return out


def exactness_figures(junit: Path, jsonl: Path) -> dict[str, Any]:
    out: dict[str, Any] = junit_counts(junit)
    if jsonl.is_file():
        out["tests_figures"] = [json.loads(line) for line in jsonl.read_text().splitlines()
                                if line.strip()]
    return out


def model_figures(log: Path) -> dict[str, Any]:
    """The JSON line ``random_model`` prints last."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


# -- the plan --------------------------------------------------------------------------


def tokenizer_dir(carry: Path) -> str:
    """Where the model's tokenizer files come from: the carried folder, else the default
    model's cache when complete (nothing is fetched: a GPU machine may have no network),
    else none (the benches then send random token ids)."""
    if (carry / "tokenizer" / "tokenizer.json").is_file():
        return str(carry / "tokenizer")
    from pagoda.model_fetch import ALIASES, COMPLETE_MARKER, default_cache_dir

    cached = default_cache_dir() / ALIASES["smollm2"].dir_name
    return str(cached) if (cached / COMPLETE_MARKER).is_file() else "none"


def plan(args: argparse.Namespace, work: Path) -> list[Part]:
    py, dry = sys.executable, args.dry_run
    model = work / ("model-toy" if dry else "model-1b")
    logs = work / "logs"
    m = str(model)
    cpu = ["--device", "cpu"] if dry else []
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    bench = [py, "-m", "pagoda.cli", "bench", "--model", m, "--no-progress", *cpu]
    workload = (["--num-requests", "4", "--prompt-len", "uniform:8,24", "--output-len", "fixed:6",
                 "--kv-cache-bytes", "64MiB"] if dry else [])
    # offline, HF loads in the same process after the engine: a bounded KV pool; the
    # launched stack sizes its pool as a server does (from the memory left on the GPU)
    pool = [] if dry else ["--kv-cache-bytes", "8GiB"]
    # the HF baseline on the engine's device; the roofline's batch-1 probe (3 x 128 steps)
    # is left out of the dry run, where it would be most of the part's time
    hf = ["--hf-batch-sizes", "2", "--hf-dtypes", "float32"] if dry else [
        "--hf-batch-sizes", "64", "--hf-dtypes", "bfloat16", "--roofline"]
    profile = (["--batch", "4", "--context", "32", "--warmup", "1", "--steps", "3",
                "--profile-steps", "1"] if dry else ["--batch", "64", "--context", "512"])
    kernel_tests = (["tests/kernels/test_cache_write.py"] if dry
                    else ["tests/kernels", "--ignore-glob=tests/kernels/test_cpu_*"])
    ceiling = (["--num-requests", "8", "--prompt-len", "fixed:8", "--output-len", "fixed:8",
                "--max-concurrency", "4"] if dry else ["--num-requests", "512"])
    scale = 0.5 if dry else 1.0
    parts = [
        Part("model", [py, "-m", "pagoda.bench.random_model", m, "--preset", "toy" if dry else "1b",
                       "--tokenizer", tokenizer_dir(args.carry), *cpu], 180 * scale,
             lambda: model_figures(logs / "model.log"), needs_model=False),
        Part("kernel_tests", [*pytest, f"--junitxml={work / 'kernel_tests.xml'}", *kernel_tests],
             240 * scale, lambda: junit_counts(work / "kernel_tests.xml"), needs_model=False,
             outputs=(work / "kernel_tests.xml",)),
        Part("exactness", [*pytest, f"--junitxml={work / 'exactness.xml'}", "tests/gpu",
                           "tests/worker/test_cuda_graphs.py", "-m", "gpu"],
             180 * scale,
             lambda: exactness_figures(work / "exactness.xml", work / "exactness.jsonl"),
             env={"PAGODA_GPU_TEST_MODEL": m,
                  "PAGODA_GPU_CHECK_FIGURES": str(work / "exactness.jsonl")},
             outputs=(work / "exactness.xml", work / "exactness.jsonl")),
        Part("step_profile", [py, "-m", "pagoda.bench.step_profile", "--model", m, *cpu, *profile,
                              "--output-json", str(work / "step_profile.json")], 150 * scale,
             lambda: json.loads((work / "step_profile.json").read_text()),
             outputs=(work / "step_profile.json",)),
        Part("bench_offline", [*bench, *workload, *pool, "--baseline", "hf", *hf,
                               "--output-json", str(work / "bench_offline.json")], 240 * scale,
             lambda: bench_figures(work / "bench_offline.json"),
             outputs=(work / "bench_offline.json",)),
        Part("bench_launch", [*bench, "--launch", *workload, "--max-concurrency", "64",
                              "--output-json", str(work / "bench_launch.json")], 200 * scale,
             lambda: bench_figures(work / "bench_launch.json"),
             outputs=(work / "bench_launch.json",)),
        Part("pipeline_ceiling", [py, "-m", "pagoda.bench.pipeline_ceiling", "--model", m,
                                  "--transport", "http", "--no-progress", *ceiling,
                                  "--output-json", str(work / "pipeline_ceiling.json")],
             120 * scale, lambda: json.loads((work / "pipeline_ceiling.json").read_text()),
             outputs=(work / "pipeline_ceiling.json",)),
        Part("kernel_bench", [py, "-m", "kernels.bench"], 150 * scale,
             lambda: {"rows": kernel_bench_rows(logs / "kernel_bench.log")}, needs_model=False),
    ]
    return [p for p in parts if p.name in args.parts]


# -- running ---------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the part's process group, SIGKILL after a grace period."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    data = path.read_bytes() if path.is_file() else b""
    return data[-TAIL_CHARS:].decode(errors="replace")


def run_part(part: Part, deadline: float, logs: Path, base_env: dict[str, str]) -> dict[str, Any]:
    left = deadline - time.monotonic()
    if left < MIN_PART_S:
        return {"status": "not_run", "reason": f"budget spent ({left:.0f} s left)"}
    for path in part.outputs:
        path.unlink(missing_ok=True)
    timeout = min(part.timeout_s, left)
    log = logs / f"{part.name}.log"
    print(f"[gpu_check] {part.name}: {shlex.join(part.argv)} (timeout {timeout:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(part.argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**base_env, **part.env}, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = None
        except BaseException:  # Ctrl-C: the part's whole group goes with us
            _kill_group(proc)
            raise
    result: dict[str, Any] = {
        "status": "timeout" if rc is None else ("passed" if rc == 0 else "failed"),
        "seconds": round(time.monotonic() - t0, 1), "rc": rc, "timeout_s": round(timeout),
        "command": shlex.join(part.argv), "log": str(log),
    }
    if part.figures is not None:
        try:
            result["figures"] = part.figures()
        except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as e:
            result["figures_error"] = f"{type(e).__name__}: {e}"
    counts = result.get("figures") or {}
    if rc == 0 and counts.get("tests") and counts.get("skipped") == counts.get("tests"):
        result["status"] = "skipped"  # pytest passed, but nothing ran (e.g. no CUDA)
    if result["status"] != "passed":
        result["log_tail"] = _tail(log)
    print(f"[gpu_check] {part.name}: {result['status']} in {result['seconds']} s", flush=True)
    return result


def environment() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    versions = {}
    for name in ("torch", "triton", "transformers", "pyzmq", "msgspec", "fastapi", "pydantic",
                 "uvicorn"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10, check=False).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(), "executable": sys.executable, "packages": versions,
        "cuda": cuda, "torch_cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "cpu_count": os.cpu_count(), "git_commit": commit,
        "setup": os.environ.get("PAGODA_GPU_CHECK_SETUP"),
    }


def _tests_note(f: dict[str, Any]) -> str:
    return f"{f['passed']} passed, {f['failures'] + f['errors']} failed, {f['skipped']} skipped"


def _bench_note(f: dict[str, Any]) -> str:
    note = f"{f['output_tok_s']:.0f} output tok/s, TPOT p50 {f['tpot_p50_s'] * 1e3:.1f} ms"
    if f.get("output_tok_s_vs_hf_best"):
        note += f", {f['output_tok_s_vs_hf_best']:.2f}x HF best ({f['hf_best']})"
    return note


def _profile_note(f: dict[str, Any]) -> str:
    busy, kernels = f["gpu_busy_share"], f["cuda_kernels_per_step"]
    return (f"{f['wall_s_per_step']['median'] * 1e3:.2f} ms/step, {f['cpu_ops_per_step']:.0f} "
            f"CPU ops, {'-' if kernels is None else f'{kernels:.0f}'} CUDA kernels, GPU busy "
            f"{'-' if busy is None else f'{busy:.0%}'}")


NOTES: dict[str, Callable[[dict[str, Any]], str]] = {  # part -> its headline from its figures
    "model": lambda f: f"{f['parameters'] / 1e6:,.0f} M parameters, tokenizer {f['tokenizer']}",
    "kernel_tests": _tests_note,
    "exactness": _tests_note,
    "step_profile": _profile_note,
    "bench_offline": _bench_note,
    "bench_launch": _bench_note,
    "kernel_bench": lambda f: f"{len(f['rows'])} rows",
}


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One line per part: status, seconds and its headline figure."""
    lines = []
    for name, r in report["parts"].items():
        f = r.get("figures")
        try:
            note = NOTES[name](f) if f else (r.get("reason") or r.get("figures_error") or "")
        except (KeyError, TypeError, ValueError) as e:
            note = f"({type(e).__name__}: {e})"
        lines.append(f"  {name:<14} {r['status']:<8} {r.get('seconds', 0):>6} s  {note}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the CPU, toy sizes: checks the check")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    p.add_argument("--budget-s", type=float, default=None,
                   help="overall seconds (default 540; 300 for --dry-run)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/pagoda-gpu-check"),
                   help="model, logs and part outputs (the model is kept for the next run)")
    p.add_argument("--report", type=Path, default=None, help="default: WORKDIR/gpu_check.json")
    p.add_argument("--carry", type=Path, default=Path(os.environ.get("PAGODA_GPU_CARRY", ".gpu")),
                   help="the carried folder (tokenizer/, wheels/) [env PAGODA_GPU_CARRY]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        print(f"gpu_check: unknown part(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    work, args.carry = args.workdir.resolve(), args.carry.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    report_path = (args.report or work / "gpu_check.json").resolve()
    budget = args.budget_s or (300.0 if args.dry_run else 540.0)
    deadline = time.monotonic() + budget
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if not args.dry_run:
        base_env.pop("TRITON_INTERPRET", None)  # kernels compiled for the GPU
    report: dict[str, Any] = {"dry_run": args.dry_run, "budget_s": budget,
                              "environment": environment(), "parts": {}}
    started = time.monotonic()
    try:
        for part in plan(args, work):
            if part.needs_model and report["parts"].get("model", {}).get("status") not in (
                    None, "passed"):
                report["parts"][part.name] = {"status": "not_run", "reason": "no model"}
                continue
            report["parts"][part.name] = run_part(part, deadline, work / "logs", base_env)
    finally:
        report["seconds"] = round(time.monotonic() - started, 1)
        statuses = [r["status"] for r in report["parts"].values()]
        report["passed"] = bool(statuses) and all(s in ("passed", "skipped") for s in statuses)
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    env = report["environment"]
    print(f"GPU check ({'dry run, ' if args.dry_run else ''}{env['device_name'] or 'no CUDA'}): "
          f"{'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']} s")
    print("\n".join(summary_lines(report)))
    print(f"report: {report_path}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
