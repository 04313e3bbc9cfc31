"""``--baseline vllm`` with ``--vllm-rounds``: the runner's rounds protocol and the
session around it (pagoda/bench/vllm_runner.py, baseline_vllm.py), and the rounds in
``pagoda bench``'s report. The runner and the session are the real ones; under the
runner a stand-in ``vllm`` package (tests/support/fake_vllm) takes the engine's place
where vLLM is not installed; the real engine's test is in test_bench_run.py."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from pagoda.bench import baseline_vllm
from pagoda.bench.baseline_vllm import vllm_session
from pagoda.bench.workload import Workload
from pagoda.cli import main as pagoda_main

FAKE_VLLM = Path(__file__).resolve().parents[1] / "support" / "fake_vllm"


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This interpreter as vLLM's, the stand-in package on its path; the log of every
    generate call's prompts' first tokens."""
    monkeypatch.setattr(baseline_vllm, "vllm_python", lambda: Path(sys.executable))
    monkeypatch.setenv("PYTHONPATH", str(FAKE_VLLM))
    log = tmp_path / "generate.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return log


def _calls(log: Path) -> list[list[int]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_session_runs_each_round_on_its_salted_prompts_when_told(fake_vllm: Path) -> None:
    work = Workload([[5, 6, 7], [9, 10]], [3, 2])
    rounds = [work.salted(4, 100), work.salted(5, 100)]
    with vllm_session("model-dir", work, "float32", 64, [1, 2, 3], 4, rounds=rounds) as s:
        assert s is not None
        assert s.figures["token_ids"] == [[5, 5, 5], [9, 9]]  # the first pass's
        assert s.figures["output_tokens"] == 5
        # warm-up, first pass, 3 x (TTFT probe, TPOT probe): nothing of the rounds yet
        before = len(_calls(fake_vllm))
        assert before == 8
        second = s.run_round(2)
        first = s.run_round(1)
        assert (first["round"], second["round"]) == (1, 2)
        assert first["output_tokens"] == second["output_tokens"] == 5
        assert first["output_tok_s"] > 0
    assert _calls(fake_vllm)[before:] == [[10, 14], [9, 13]]  # round 2's, then round 1's


def test_session_without_rounds_is_the_one_shot_baseline(fake_vllm: Path) -> None:
    work = Workload([[5, 6, 7]], [2])
    figures = baseline_vllm.run_vllm_baseline("m", work, "float32", 64, [1, 2], 3)
    assert figures is not None and figures["token_ids"] == [[5, 5]]
    with vllm_session("m", work, "float32", 64, [1, 2], 3) as s:
        assert s is not None
        with pytest.raises(RuntimeError, match="without rounds"):
            s.run_round(1)


def test_a_runner_dying_mid_round_raises_with_its_log(
        fake_vllm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = Workload([[5, 6, 7]], [2])
    monkeypatch.setenv("FAKE_VLLM_EXIT_AT", "10")  # 8 calls up to ready, then round 1, 2
    with vllm_session("m", work, "float32", 64, [1, 2], 3,
                      rounds=[work.salted(1, 50), work.salted(2, 50)]) as s:
        assert s is not None
        assert s.run_round(1)["round"] == 1
        with pytest.raises(RuntimeError, match=r"vLLM baseline failed \(exit 3\)"):
            s.run_round(2)
        assert s._process.poll() == 3  # reaped, not left behind


def test_rounds_must_keep_the_output_lengths(fake_vllm: Path) -> None:
    work = Workload([[5, 6, 7]], [2])
    longer = Workload([[6, 6, 7]], [3])
    with (pytest.raises(ValueError, match="output lengths"),
          vllm_session("m", work, "float32", 64, [1], 2, rounds=[longer])):
        pass


def test_bench_alternates_pagoda_and_vllm_passes_on_fresh_prompts(
        fake_vllm: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``--vllm-rounds 3``: the first pair, then a vLLM-first and a pagoda-first round, each
    on prompts neither engine saw (pagoda finds no cached prefix, vLLM gets new first
    tokens); the headline is the geometric mean of rounds 1 on (their passes ran back to
    back), the first pair's ratio kept beside it."""
    out_json = tmp_path / "r.json"
    rc = pagoda_main(["bench", "--model", str(tiny_llama_dir), "--num-requests", "3",
                      "--prompt-len", "20,40", "--output-len", "fixed:4", "--dtype", "float32",
                      "--baseline", "vllm", "--vllm-rounds", "3", "--output-json",
                      str(out_json), "--no-progress"])
    assert rc == 0
    report = json.loads(out_json.read_text())
    vs = report["comparison_vllm"]
    rounds = vs["rounds"]
    assert [r["vllm_first"] for r in rounds] == [False, True, False]
    assert [r["pagoda_prefix_cache_hits"] for r in rounds[1:]] == [0, 0]
    assert rounds[0]["pagoda_output_tok_s"] == pytest.approx(report["pagoda"]["output_tok_s"])
    assert rounds[0]["vllm_output_tok_s"] == pytest.approx(report["baseline_vllm"]["output_tok_s"])
    for r in rounds:
        assert r["output_tok_s_ratio"] == pytest.approx(r["pagoda_output_tok_s"] / r["vllm_output_tok_s"])
    assert vs["output_tok_s_ratio"] == pytest.approx(  # the back-to-back rounds only
        statistics.geometric_mean([r["output_tok_s_ratio"] for r in rounds[1:]]))
    assert vs["first_pass_output_tok_s_ratio"] == pytest.approx(rounds[0]["output_tok_s_ratio"])
    # vLLM's passes: the workload, then rounds 1 and 2, each with new first tokens
    passes = [c for c in _calls(fake_vllm) if len(c) == 3]
    assert len(passes) == 3 and len({tuple(p) for p in passes}) == 3


def test_vllm_rounds_needs_the_vllm_baseline(tiny_llama_dir: Path) -> None:
    with pytest.raises(SystemExit, match="--vllm-rounds"):
        pagoda_main(["bench", "--model", str(tiny_llama_dir), "--vllm-rounds", "2"])
