"""The GPU check (scripts/gpu_check.sh, pagoda/bench/gpu_check.py): its dry run on the CPU
end to end, each part's command line against the parser that will read it, and the
runner's timeouts, budget and figures."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_completes_and_writes_one_report(tmp_path: Path) -> None:
    """The whole check at toy sizes on the CPU (about a minute on 2 cores)."""
    report_path = tmp_path / "out" / "report.json"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--workdir", str(tmp_path / "work"),
         "--report", str(report_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**gpu_check.os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith(f"report: {report_path}")
    report = json.loads(report_path.read_text())
    assert report["dry_run"] and report["passed"]
    parts = report["parts"]
    assert list(parts) == list(gpu_check.PARTS)
    assert {name: p["status"] for name, p in parts.items()} == {
        **{name: "passed" for name in gpu_check.PARTS}, "exactness": "skipped"}
    assert parts["kernel_tests"]["figures"]["passed"] > 0
    assert parts["exactness"]["figures"]["skipped"] == parts["exactness"]["figures"]["tests"] > 0
    profile = parts["step_profile"]["figures"]
    assert profile["config"]["device"] == "cpu" and profile["gpu_busy_share"] is None
    assert profile["cpu_ops_per_step"] > 0
    for name in ("bench_offline", "bench_launch"):
        f = parts[name]["figures"]
        assert f["num_completed"] == f["num_requests"] == 4 and f["output_tok_s"] > 0, name
    assert parts["bench_offline"]["figures"]["hf_device"] == "cpu"  # the engine's device
    ceiling = parts["pipeline_ceiling"]["figures"]
    assert ceiling["failed"] == 0 and ceiling["output_tokens"] == 8 * 8 and ceiling["steps"] > 0
    assert [r["kernel"] for r in parts["kernel_bench"]["figures"]["rows"]] == [
        "decode", "decode", "prefill", "prefill", "cache_write"]
    assert report["environment"]["cuda"] is False


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry-run"])
def test_every_part_command_parses(dry: bool, tmp_path: Path) -> None:
    """A typo in a part's flags would cost a GPU run: each command line is parsed here by
    the parser that will read it there."""
    from pagoda.bench import cli as bench_cli
    from pagoda.bench import step_profile

    args = gpu_check.build_parser().parse_args(["--dry-run"] if dry else [])
    args.parts = list(gpu_check.PARTS)
    parts = {p.name: p for p in gpu_check.plan(args, tmp_path)}
    assert list(parts) == list(gpu_check.PARTS)
    for name in ("bench_offline", "bench_launch"):
        argv = parts[name].argv
        bench = bench_cli.build_parser().parse_args(argv[argv.index("bench") + 1:])
        offline_pool = 8 * 2**30 if name == "bench_offline" else None  # launched: a server's
        assert bench.kv_cache_bytes == (64 * 2**20 if dry else offline_pool)
        assert bench.launch == (name == "bench_launch")
        assert (bench.device == "cpu") == dry
    offline = bench_cli.build_parser().parse_args(
        parts["bench_offline"].argv[parts["bench_offline"].argv.index("bench") + 1:])
    assert offline.baseline == ["hf"] and offline.roofline == (not dry)
    argv = parts["step_profile"].argv
    profile = step_profile.build_parser().parse_args(argv[argv.index("--model"):])
    assert (profile.batch, profile.context) == ((4, 32) if dry else (64, 512))
    argv = parts["model"].argv
    assert argv[argv.index("--preset") + 1] == ("toy" if dry else "1b")


def test_a_part_over_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild-alive"
    # the part starts a grandchild that would write the marker after 3 s, then hangs
    grandchild = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              f"{grandchild!r}]); time.sleep(60)")
    part = gpu_check.Part("hang", [sys.executable, "-c", script], timeout_s=1.5, needs_model=False)
    t0 = time.monotonic()
    result = gpu_check.run_part(part, time.monotonic() + 60, tmp_path, {})
    assert result["status"] == "timeout" and result["rc"] is None
    assert time.monotonic() - t0 < 15
    time.sleep(3)
    assert not marker.exists(), "the part's child outlived it"


def test_parts_past_the_budget_are_not_run(tmp_path: Path) -> None:
    part = gpu_check.Part("late", [sys.executable, "-c", "pass"], timeout_s=60)
    result = gpu_check.run_part(part, time.monotonic() + 5, tmp_path, {})
    assert result["status"] == "not_run" and "budget" in result["reason"]


def test_a_failed_part_keeps_its_log_tail_and_a_figures_error(tmp_path: Path) -> None:
    part = gpu_check.Part("fails", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                          timeout_s=30, figures=lambda: json.loads((tmp_path / "no").read_text()))
    result = gpu_check.run_part(part, time.monotonic() + 60, tmp_path, {})
    assert result["status"] == "failed" and result["rc"] == 3
    assert "boom" in result["log_tail"]
    assert result["figures_error"].startswith("FileNotFoundError")


def test_junit_counts_and_kernel_bench_rows(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" '
                     'failures="2" skipped="3" tests="10"></testsuite></testsuites>')
    assert gpu_check.junit_counts(junit) == {"tests": 10, "failures": 2, "errors": 1,
                                             "skipped": 3, "passed": 4}
    from kernels.bench import Row

    rows = [Row("decode", "batch=64 ctx=1024", 41.5e-6, 3512.0, "GB/s", 0.7317, 80.1e-6, 3.1e-3),
            Row("prefill", "batch=1 q=4096 ctx=0", 1.2e-3, 402.0, "TFLOP/s", None, 1.0e-3, 0.0)]
    log = tmp_path / "bench.log"
    log.write_text("# H200; heads 32/8\nkernel  shape  time us\n"
                   + "\n".join(r.format() for r in rows) + "\nTraceback (most recent call last)\n")
    got = gpu_check.kernel_bench_rows(log)
    assert [(r["kernel"], r["shape"], r["unit"]) for r in got] == [
        ("decode", "batch=64 ctx=1024", "GB/s"), ("prefill", "batch=1 q=4096 ctx=0", "TFLOP/s")]
    assert got[0]["us"] == pytest.approx(41.5) and got[0]["peak_fraction"] == pytest.approx(0.732)
    assert got[0]["speedup_vs_baseline"] == pytest.approx(1.93) and got[1]["peak_fraction"] is None
