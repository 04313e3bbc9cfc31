"""``pagoda bench`` end to end on a tiny random model (offline), and the HTTP sender's
stream accounting against a small aiohttp server that streams canned SSE."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from pagoda.bench.runner_online import HttpSender, run_online
from pagoda.bench.workload import Workload
from pagoda.cli import main as pagoda_main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_offline_bench_writes_consistent_json_and_png(tiny_llama_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = pagoda_main(["bench", "--model", str(tiny_llama_dir), "--num-requests", "5",
                      "--prompt-len", "8,24", "--output-len", "fixed:6", "--max-concurrency", "3",
                      "--baseline", "hf", "--hf-batch-sizes", "1,2", "--roofline", "--dtype", "bfloat16",
                      "--output-json", str(out_json), "--output-png", str(out_png), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "output" in text and "pagoda / HF best" in text and "ceiling" in text

    png = out_png.read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000

    report = json.loads(out_json.read_text())
    assert set(report) == {"config", "pagoda", "baseline_hf", "comparison", "baseline_vllm",
                           "comparison_vllm", "roofline", "samples", "exact_match"}
    assert report["baseline_vllm"] is None
    assert report["exact_match"] is None  # the model's own KV dtype: not asked, not run
    bs1 = report["pagoda"]["bs1"]  # --roofline measures batch-1 latency against its floor
    assert bs1["ttft_s"] > 0 and bs1["tpot_s"] > 0
    assert report["config"]["mode"] == "offline" and report["config"]["max_concurrency"] == 3
    assert report["config"]["engine_dtype"] == "bfloat16"
    p = report["pagoda"]
    assert (p["num_requests"], p["num_completed"], p["num_failed"]) == (5, 5, 0)
    assert p["output_tokens"] == 5 * 6  # exact lengths through ignore_eos
    assert 5 * 8 <= p["prompt_tokens"] <= 5 * 24
    assert p["output_tok_s"] == pytest.approx(p["output_tokens"] / p["duration_s"])
    assert p["total_tok_s"] == pytest.approx((p["output_tokens"] + p["prompt_tokens"]) / p["duration_s"])
    assert p["requests_s"] == pytest.approx(5 / p["duration_s"])
    assert p["start_s"] > 0  # the offline engine's construction, as vLLM's start_s
    assert p["mean_in_flight"] <= 3 + 1e-9  # the concurrency limit held
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = p[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], key
        assert len(report["samples"][key]) == d["count"]
    assert p["ttft_s"]["count"] == p["tpot_s"]["count"] == p["e2e_s"]["count"] == 5
    assert p["itl_s"]["count"] == 5 * (6 - 1)  # one token per offline delta
    s = p["scheduler"]
    assert s["num_preemptions"] == 0 and 0 <= s["prefix_cache_hits"] <= s["prefix_cache_queries"]
    assert 0 < s["kv_usage_peak"] <= 1

    hf = report["baseline_hf"]
    assert set(hf["static_batch_output_tok_s"]) == {"float32", "bfloat16"}
    ways = [v for by_bs in hf["static_batch_output_tok_s"].values() for v in by_bs.values()]
    assert all(set(by_bs) == {"1", "2"} for by_bs in hf["static_batch_output_tok_s"].values())
    assert hf["best_output_tok_s"] == max(ways)
    assert hf["best_output_tok_s"] == hf["static_batch_output_tok_s"][hf["best_dtype"]][str(hf["best_batch_size"])]
    assert hf["one_at_a_time"]["output_tokens"] == 5 * 6
    cmp = report["comparison"]
    assert cmp["output_tok_s_ratio_vs_hf_best"] == pytest.approx(p["output_tok_s"] / hf["best_output_tok_s"])
    assert cmp["tpot_p50_ratio_vs_hf_bs1"] == pytest.approx(
        p["tpot_s"]["p50"] / hf["one_at_a_time"]["tpot_s"]["p50"])
    r = report["roofline"]
    assert r["matmul_flops"] > 1e8 and r["mem_read_bytes_s"] > 1e8
    assert r["matmul_dtype"] == "bfloat16" and r["bytes_per_param"] == 2
    assert r["fraction"] == pytest.approx(p["output_tok_s"] / r["ceiling_output_tok_s"])
    assert r["weights_read_s"] == pytest.approx(r["params"] * 2 / r["mem_read_bytes_s"])
    # the batch-1 floor at the bandwidth measured around the probe, not at the run's start
    assert len(r["bs1_mem_read_samples"]) == 2 and min(r["bs1_mem_read_samples"]) > 1e8
    assert r["bs1_mem_read_bytes_s"] == pytest.approx(sum(r["bs1_mem_read_samples"]) / 2)
    assert r["bs1_weights_read_s"] == pytest.approx(r["params"] * 2 / r["bs1_mem_read_bytes_s"])
    assert r["bs1_tpot_vs_weights_read"] == pytest.approx(bs1["tpot_s"] / r["bs1_weights_read_s"])
    assert "one read of the weights" in text
    # every step of the offline pass, beside its own roofline, by kind
    steps = r["steps"]
    assert "prefill" in steps and steps["all"]["steps"] >= 2
    assert sum(b["steps"] for kind, b in steps.items() if kind != "all") == steps["all"]["steps"]
    assert 0 < steps["all"]["seconds"] <= p["duration_s"]
    assert "beside their own roofline" in text
    assert report["samples"]["throughput_over_time"]["t_s"]


def test_exact_match_against_hf_one_at_a_time(tiny_llama_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """fp32 over the model's own cache is HF's greedy output exactly (the oracle agrees
    with the engine where nothing changes tokens); a bf16 KV cache under fp32 turns the
    check on by itself and reports its rate."""
    out_json = tmp_path / "r.json"
    common = ["bench", "--model", str(tiny_llama_dir), "--num-requests", "4", "--prompt-len",
              "8,40", "--output-len", "fixed:24", "--dtype", "float32", "--no-progress",
              "--output-json", str(out_json)]
    assert pagoda_main([*common, "--exact-match", "3"]) == 0
    e = json.loads(out_json.read_text())["exact_match"]
    assert (e["requests"], e["exact"], e["exact_rate"], e["token_agreement"]) == (3, 3, 1.0, 1.0)
    assert e["first_difference"] == [None] * 3 and e["kv_cache_dtype"] == "float32"
    assert "exact match vs HF transformers float32" in capsys.readouterr().out

    assert pagoda_main([*common, "--kv-cache-dtype", "bfloat16"]) == 0
    report = json.loads(out_json.read_text())
    e = report["exact_match"]
    assert report["config"]["engine_kv_cache_dtype"] == "bfloat16"
    assert e["requests"] == 4 and e["kv_cache_dtype"] == "bfloat16"  # default 16, 4 there are
    assert 0 <= e["exact"] <= 4 and 0 < e["token_agreement"] <= 1
    assert "(KV cache bfloat16)" in capsys.readouterr().out


def test_exact_match_figures() -> None:
    from pagoda.bench.exact_match import compare

    got = compare([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [0, 8]])
    assert (got["exact"], got["requests"]) == (1, 3)
    assert got["exact_rate"] == pytest.approx(1 / 3)
    assert got["token_agreement"] == pytest.approx((3 + 1 + 0) / 8)
    assert got["first_difference"] == [None, 1, 0]
    with pytest.raises(ValueError):
        compare([[1]], [])


def test_vllm_baseline_without_its_environment_is_skipped_with_a_message(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from pagoda.bench import baseline_vllm

    monkeypatch.setattr(baseline_vllm, "VENV", tmp_path / "no-venv")
    out_json = tmp_path / "r.json"
    rc = pagoda_main(["bench", "--model", str(tiny_llama_dir), "--num-requests", "3",
                      "--prompt-len", "8,16", "--output-len", "fixed:4", "--baseline", "vllm",
                      "--dtype", "float32", "--output-json", str(out_json), "--no-progress"])
    assert rc == 0
    assert "--baseline vllm skipped" in capsys.readouterr().err
    report = json.loads(out_json.read_text())
    assert report["baseline_vllm"] is None
    bs1 = report["pagoda"]["bs1"]  # pagoda's own batch-1 probe still ran
    assert bs1["ttft_s"] > 0 and bs1["tpot_s"] > 0


@pytest.mark.skipif(not (Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")
                    .is_file(), reason="no .venv-vllm (bash scripts/setup_vllm.sh makes it)")
def test_vllm_runs_the_same_requests_to_the_same_tokens(tmp_path: Path) -> None:
    """The real vLLM CPU engine, in its own environment, on pagoda's workload: greedy
    float32 tokens equal pagoda's offline engine's; with a round (``--vllm-rounds``) the
    engine stays up and runs the salted copy when told. (vLLM's CPU attention takes
    head_dim 64 and up, so this tiny model has 64-wide heads.)"""
    from pagoda import LLM
    from pagoda.bench.baseline_vllm import vllm_session
    from pagoda.bench.runner_offline import greedy_exact
    from support.checkpoints import make_checkpoint

    tiny_llama_dir = make_checkpoint(tmp_path / "tiny", "llama", seed=21, head_dim=64)

    work = Workload([[5, 6, 7, 8, 9, 10], list(range(30, 50))], [12, 8])
    with vllm_session(str(tiny_llama_dir), work, "float32", 1024, [5, 6, 7, 8] * 4, 8,
                      rounds=[work.salted(1, 100)]) as session:
        assert session is not None
        figures = session.figures
        assert figures["output_tokens"] == 20
        again = session.run_round(1)
        assert again["round"] == 1 and again["output_tokens"] == 20 and again["output_tok_s"] > 0
    with LLM(str(tiny_llama_dir), dtype="float32", device="cpu") as llm:
        ours = llm.generate(work.prompts, [greedy_exact(n) for n in work.output_lens],
                            use_tqdm=False)
    assert figures["token_ids"] == [o.outputs[0].token_ids for o in ours]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _run_against(handler: Handler, work: Workload) -> list:  # type: ignore[type-arg]
    """``run_online`` with an ``HttpSender`` against a local server answering
    ``POST /v1/completions`` with ``handler``."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    sender = HttpSender(f"http://127.0.0.1:{sock.getsockname()[1]}/v1")
    try:
        return await run_online(sender, work, progress=False)
    finally:
        await sender.aclose()
        await runner.cleanup()


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_http_sender_counts_tokens_from_the_stream(newline: str) -> None:
    """Text chunks count one token each; the usage chunk corrects the total (a held-back
    token lands on the last delta); events split across network writes, and CRLF line
    ends, read the same; the request body asks for exact greedy output."""
    bodies: list[dict[str, object]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        events = [{"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "bc", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}]
        sse = "".join(f"data: {json.dumps(e)}{newline}{newline}" for e in events)
        sse = (sse + f"data: [DONE]{newline}{newline}").encode()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for at in range(0, len(sse), 37):  # pieces that cut events and lines anywhere
            await response.write(sse[at:at + 37])
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    (rec,) = asyncio.run(_run_against(handler, Workload([[5, 6, 7]], [4])))
    assert rec.ok and rec.num_output_tokens == 4
    assert [n for _, n in rec.chunks] == [1, 1, 2]
    assert bodies[0]["prompt"] == [5, 6, 7] and bodies[0]["max_tokens"] == 4
    assert bodies[0]["ignore_eos"] is True and bodies[0]["temperature"] == 0.0
    assert bodies[0]["stream_options"] == {"include_usage": True}


def test_http_sender_records_a_refused_request() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    records = asyncio.run(_run_against(handler, Workload([[5], [6]], [2, 2])))
    assert all(not r.ok and "503" in (r.error or "") for r in records)


def test_http_sender_raises_on_a_stream_error_event() -> None:
    """An error event in the stream (a server that fails mid-way) fails the request."""
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n')
        await response.write(b'data: {"error": {"message": "engine died"}}\n\n')
        await response.write_eof()
        return response

    (rec,) = asyncio.run(_run_against(handler, Workload([[5]], [3])))
    assert not rec.ok and "engine died" in (rec.error or "")


def test_online_beside_offline_serves_the_same_requests(tiny_smollm_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``--online``: the offline run, then the same requests through a launched stack over
    HTTP with two frontends; the report has both, their ratio and the CPU by role."""
    out_json = tmp_path / "r.json"
    rc = pagoda_main(["bench", "--model", str(tiny_smollm_dir), "--num-requests", "6",
                      "--prompt-len", "8,24", "--output-len", "fixed:5", "--online",
                      "--frontends", "2", "--max-concurrency", "4", "--dtype", "float32",
                      "--output-json", str(out_json), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "online / offline output tok/s" in text and "online CPU seconds" in text
    report = json.loads(out_json.read_text())
    o, p = report["online"], report["pagoda"]
    assert (o["num_completed"], o["num_failed"], o["output_tokens"]) == (6, 0, 30)
    assert o["prompt_tokens"] == p["prompt_tokens"]  # the same requests
    assert (o["transport"], o["frontends"], o["max_concurrency"]) == ("http", 2, 4)
    assert o["mean_in_flight"] <= 4 + 1e-9
    assert report["comparison_online"]["output_tok_s_ratio"] == pytest.approx(
        o["output_tok_s"] / p["output_tok_s"])
    cpu = o["cpu_s"]
    assert set(cpu) == {"worker", "scheduler", "frontends", "client", "wall_s"}
    # clock ticks are 10 ms: the scheduler's and frontends' share of a run this short can
    # read 0; the worker's forward passes and the client's own time cannot
    assert all(cpu[role] >= 0 for role in ("scheduler", "frontends"))
    assert cpu["worker"] > 0 and cpu["client"] > 0
    assert p["cpu_s"] is None  # the offline run is one process: nothing to split


def test_online_rounds_alternate_and_never_hit_a_cached_prefix(
        tiny_smollm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--online-rounds 3``: offline/online, online/offline, offline/online with both
    engines up; every pass of every round computes all its prompt tokens (each round's
    prompts are salted, so neither engine finds an earlier round's blocks), and the
    headline ratio is the rounds' geometric mean."""
    out_json = tmp_path / "r.json"
    rc = pagoda_main(["bench", "--model", str(tiny_smollm_dir), "--num-requests", "4",
                      "--prompt-len", "40,60", "--output-len", "fixed:3", "--online",
                      "--online-rounds", "3", "--max-concurrency", "4", "--dtype", "float32",
                      "--output-json", str(out_json), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "geometric mean of 3 rounds" in text and "round 2:" in text
    report = json.loads(out_json.read_text())
    rounds = report["comparison_online"]["rounds"]
    assert [r["online_first"] for r in rounds] == [False, True, False]
    for r in rounds:
        assert r["offline_output_tok_s"] > 0 and r["online_output_tok_s"] > 0
        assert r["output_tok_s_ratio"] == pytest.approx(
            r["online_output_tok_s"] / r["offline_output_tok_s"])
        assert r["offline_prefix_cache_hits"] == 0 and r["online_prefix_cache_hits"] == 0
        assert r["online_cpu_s"]["worker"] > 0
    assert rounds[0]["offline_output_tok_s"] == pytest.approx(report["pagoda"]["output_tok_s"])
    assert rounds[0]["online_output_tok_s"] == pytest.approx(report["online"]["output_tok_s"])
    ratios = [r["output_tok_s_ratio"] for r in rounds]
    assert report["comparison_online"]["output_tok_s_ratio"] == pytest.approx(
        math.prod(ratios) ** (1 / 3))


def test_online_launches_repeat_the_rounds_on_a_fresh_stack(
        tiny_smollm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--online-rounds 2 --online-launches 2``: two rounds on one stack, two more on a
    newly launched one (another worker process), in alternating order within each; the
    salts keep counting across launches, so no pass of either engine hits a cached
    prefix; the headline is the geometric mean of all four rounds."""
    out_json = tmp_path / "r.json"
    rc = pagoda_main(["bench", "--model", str(tiny_smollm_dir), "--num-requests", "3",
                      "--prompt-len", "40,60", "--output-len", "fixed:3", "--online",
                      "--online-rounds", "2", "--online-launches", "2", "--max-concurrency",
                      "3", "--dtype", "float32", "--output-json", str(out_json), "--no-progress"])
    assert rc == 0
    assert "geometric mean of 4 rounds in alternating order over 2 launches" in capsys.readouterr().out
    report = json.loads(out_json.read_text())
    rounds = report["comparison_online"]["rounds"]
    assert [r["launch"] for r in rounds] == [0, 0, 1, 1]
    assert [r["online_first"] for r in rounds] == [False, True, False, True]
    pids = [r["worker_pid"] for r in rounds]
    assert pids[0] == pids[1] != pids[2] == pids[3]
    assert all(r["offline_prefix_cache_hits"] == 0 and r["online_prefix_cache_hits"] == 0
               for r in rounds)
    assert report["comparison_online"]["output_tok_s_ratio"] == pytest.approx(
        math.prod(r["output_tok_s_ratio"] for r in rounds) ** (1 / 4))


def test_online_rounds_need_online_and_a_positive_count() -> None:
    with pytest.raises(SystemExit, match="--online-rounds"):
        pagoda_main(["bench", "--online-rounds", "2", "--no-progress"])
    with pytest.raises(SystemExit, match="--online-rounds"):
        pagoda_main(["bench", "--online", "--online-rounds", "0", "--no-progress"])
    with pytest.raises(SystemExit, match="--online-launches"):
        pagoda_main(["bench", "--online", "--online-launches", "2", "--no-progress"])


def test_online_with_launch_is_refused() -> None:
    with pytest.raises(SystemExit, match="--online"):
        pagoda_main(["bench", "--online", "--launch", "--no-progress"])
