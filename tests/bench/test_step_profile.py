"""The decode-step profile (``python -m pagoda.bench.step_profile``) on the CPU with a tiny
random model, its event summary on fabricated CUDA events, and the random-model maker."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from pagoda.bench import random_model, step_profile
from services.worker.runner_builder import RunnerSpec, build_runner


def test_decode_steps_advance_every_request_by_one_token(tiny_llama_dir: Path) -> None:
    runner = build_runner(tiny_llama_dir, RunnerSpec(num_kv_blocks=64, dtype="float32",
                                                     device="cpu")).runner
    step = step_profile.decode_driver(runner, batch=3, context=20, num_steps=4)
    for _ in range(4):
        step()
    assert sorted(runner.requests) == [0, 1, 2]
    for state in runner.requests.values():
        assert state.num_computed_tokens == 20 + 4  # the seating step computed token 20
        assert len(state.token_ids) == 20 + 5  # and each of the 5 steps sampled one
    with pytest.raises(ValueError, match="needs"):
        step_profile.decode_driver(runner, batch=8, context=200, num_steps=4)


def test_cpu_profile_reports_ops_and_wall_time_and_no_gpu_figures(
        tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = step_profile.main(["--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32",
                            "--batch", "3", "--context", "24", "--warmup", "1", "--steps", "3",
                            "--profile-steps", "2", "--top", "5", "--output-json", str(out)])
    assert rc == 0
    assert "decode step: batch 3, context 24" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["config"]["device"] == "cpu" and r["config"]["dtype"] == "float32"
    assert r["config"]["kv_cache_dtype"] == "float32"
    w = r["wall_s_per_step"]
    assert 0 < w["min"] <= w["median"] <= w["max"]
    assert r["output_tok_s"] == pytest.approx(3 / w["median"])
    assert 0 < r["top_level_cpu_ops_per_step"] <= r["cpu_ops_per_step"]
    assert r["cpu_ops_per_step"] == int(r["cpu_ops_per_step"])  # the same ops every step
    for key in ("cuda_kernels_per_step", "cuda_launch_calls_per_step", "gpu_time_s_per_step",
                "gpu_busy_share", "top_cuda_kernels"):
        assert r[key] is None, key
    top = r["top_cpu_ops"]
    rc = step_profile.main(["--model", str(tiny_llama_dir), "--dtype", "float32",
                            "--kv-cache-dtype", "bfloat16", "--batch", "2", "--context", "20",
                            "--warmup", "1", "--steps", "1", "--profile-steps", "1",
                            "--output-json", str(out)])
    assert rc == 0 and "cpu float32 (KV cache bfloat16)" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["kv_cache_dtype"] == "bfloat16"
    assert 0 < len(top) <= 5
    assert [o["us_per_step"] for o in top] == sorted((o["us_per_step"] for o in top), reverse=True)


def _event(name: str, device: DeviceType, us: float = 0.0, parent: object = None,
           is_async: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, is_async=is_async, cpu_parent=parent,
                           self_cpu_time_total=us,
                           time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_cuda_events_give_kernels_launches_and_the_busy_share() -> None:
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    linear = _event("aten::linear", cpu, 30.0)
    events = []
    for _ in range(2):  # two profiled steps, the same each
        events += [linear, _event("aten::mm", cpu, 10.0, parent=linear),
                   _event("cudaLaunchKernel", cpu, 4.0, parent=linear),
                   _event("cuLaunchKernel", cpu, 4.0),
                   _event("ampere_sgemm", gpu, 100.0), _event("triton_decode", gpu, 50.0),
                   _event("Memcpy DtoH (Device -> Pinned)", gpu, 10.0),
                   _event("async", cpu, 1.0, is_async=True)]
    s = step_profile.summarize_events(events, num_steps=2, wall_s=400e-6, on_cuda=True, top=2)
    assert s["cpu_ops_per_step"] == 2 and s["top_level_cpu_ops_per_step"] == 1
    assert s["cuda_kernels_per_step"] == 2  # the copy is GPU time, not a kernel
    assert s["cuda_launch_calls_per_step"] == 2
    assert s["gpu_time_s_per_step"] == pytest.approx(160e-6)
    assert s["gpu_busy_share"] == pytest.approx(0.4)
    assert [k["name"] for k in s["top_cuda_kernels"]] == ["ampere_sgemm", "triton_decode"]
    assert s["top_cpu_ops"][0] == {"name": "aten::linear", "calls_per_step": 1.0,
                                   "us_per_step": 30.0}


def test_random_model_is_a_loadable_checkpoint_made_once(tmp_path: Path) -> None:
    shape = {**random_model.PRESETS["toy"], "vocab_size": 256}
    path = random_model.make_random_model(tmp_path / "m", shape, dtype="bfloat16", seed=3)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] and config["dtype"] == "bfloat16"
    assert (path / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".m.partial-*"))  # the staging directory is gone
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert random_model.make_random_model(path, shape) == path  # kept, not made again
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    from safetensors.torch import load_file

    weights = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert sum(t.numel() for t in weights.values()) == random_model.count_parameters(shape)


def test_the_1b_preset_is_the_shape_asked_for() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = random_model.PRESETS["1b"]
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
            shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]) == (
        2048, 16, 32, 8, 8192, 49152)
    with torch.device("meta"):  # no memory: the parameter count alone
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape))
    n = sum(p.numel() for p in model.parameters())
    assert n == random_model.count_parameters(shape) == 1_073_809_408
