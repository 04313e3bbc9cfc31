"""The engine on CUDA against HF transformers on CUDA: greedy tokens and logits.

The runner is the one a worker builds on CUDA (``runner_builder``: Triton attention over
the paged cache, and the decode CUDA graphs where the build captures them); six prompts
of 5-700 tokens prefill in one step and decode together.
- float32: the logits of the prefill and of every decode step match one HF forward over
  the final sequence (1e-3 of the logit range), and the greedy tokens equal HF
  ``generate``'s for each prompt alone; a differing token passes only where HF's own
  top two are that close (a tie), and the comparison of that prompt stops there.
- bfloat16: measured against HF float32, beside HF's own bf16 model: our mean error must
  be of the same size as HF bf16's and our top-1 agree about as often.

Models: a random Llama with spread weights (well-separated logits, head_dim 128, GQA 2)
and, when ``PAGODA_GPU_TEST_MODEL`` names a directory, that model too (the GPU check
passes its random 1 B model). Every test is marked ``gpu``: without CUDA it is skipped
(tests/conftest.py). With ``PAGODA_GPU_CHECK_FIGURES`` set, each test appends its
figures to that JSONL file (scripts/gpu_check.sh gathers them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.runner_builder import RunnerSpec, build_runner
from shared.config import EngineSettings
from support.checkpoints import load_hf, make_checkpoint
from support.paged import PagedDriver

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
LENGTHS = [5, 17, 64, 150, 333, 700]
NUM_DECODE = 24
TOLERANCE = 1e-3  # of the reference's logit range


@pytest.fixture(scope="module", params=["spread-llama", "env-model"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "env-model":
        path = os.environ.get("PAGODA_GPU_TEST_MODEL")
        if not path:
            pytest.skip("PAGODA_GPU_TEST_MODEL is not set")
        return Path(path)
    return make_checkpoint(tmp_path_factory.mktemp("spread-llama"), "llama", seed=31,
                           hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                           vocab_size=4096, max_position_embeddings=2048)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A test's figures, appended to ``$PAGODA_GPU_CHECK_FIGURES`` (JSONL) at its end."""
    out: dict[str, Any] = {}
    yield out
    path = os.environ.get("PAGODA_GPU_CHECK_FIGURES")
    if path and out:
        with open(path, "a") as f:
            f.write(json.dumps({"test": request.node.name, **out}) + "\n")


def run_engine(model_dir: Path, dtype: str, device: str = DEVICE
               ) -> tuple[PagedDriver, list[str], list[dict[str, torch.Tensor]]]:
    """All prompts prefilled in one step, then NUM_DECODE greedy decode steps together;
    the driver (tokens) and each step's logits by request."""
    per_seq = -(-(max(LENGTHS) + NUM_DECODE + 1) // 16)
    # max_num_seqs: the batch, which bounds the decode CUDA graphs captured for it
    settings = EngineSettings(model=str(model_dir), num_kv_blocks=len(LENGTHS) * per_seq + 8,
                              dtype=dtype, device=device, max_num_seqs=len(LENGTHS))
    runner = build_runner(model_dir, RunnerSpec.from_settings(settings)).runner
    gen = torch.Generator().manual_seed(17)
    driver = PagedDriver(runner, seed=5)
    ids = [f"p{n}" for n in LENGTHS]
    vocab = runner.model.config.vocab_size
    for rid, n in zip(ids, LENGTHS):
        driver.add(rid, torch.randint(3, vocab, (n,), generator=gen).tolist())
    steps = [driver.prefill(ids)[1]]
    steps += [driver.decode(ids)[1] for _ in range(NUM_DECODE)]
    return driver, ids, steps


def hf_model(model_dir: Path, dtype: torch.dtype, device: str = DEVICE) -> torch.nn.Module:
    return load_hf(model_dir).to(device=device, dtype=dtype)


def check_float32(model_dir: Path, figures: dict[str, Any], device: str = DEVICE) -> None:
    driver, ids, steps = run_engine(model_dir, "float32", device)
    hf = hf_model(model_dir, torch.float32, device)
    worst, ties, compared = 0.0, 0, 0
    for rid, n in zip(ids, LENGTHS):
        tokens = driver.tokens[rid]
        with torch.no_grad():
            ref = hf(torch.tensor([tokens[:-1]], device=device)).logits[0].float().cpu()
        for s, logits in enumerate(steps):  # logits[rid] scores position n - 1 + s
            want, got = ref[n - 1 + s], logits[rid].float().cpu()
            scale = float(want.max() - want.min())
            diff = float((got - want).abs().max())
            worst = max(worst, diff / scale)
            assert diff <= TOLERANCE * scale, f"{rid} step {s}: max diff {diff:.3g}, range {scale:.3g}"
        with torch.no_grad():
            out = hf.generate(torch.tensor([tokens[:n]], device=device), max_new_tokens=NUM_DECODE + 1,
                              do_sample=False, attention_mask=torch.ones(1, n, dtype=torch.long,
                                                                         device=device),
                              pad_token_id=0)
        expected, ours = out[0, n:].tolist(), driver.output(rid)
        for j, (a, b) in enumerate(zip(ours, expected)):
            compared += 1
            if a != b:  # only a tie in HF's own logits may part the two
                row = ref[n - 1 + j]
                gap = float(row[b] - row[a])
                assert gap <= TOLERANCE * float(row.max() - row.min()), (
                    f"{rid}: token {j} is {a}, HF generate gave {b} (logit gap {gap:.3g})")
                ties += 1
                break
    figures.update(max_diff_over_range=worst, tokens_compared=compared, ties=ties)


def check_bfloat16(model_dir: Path, figures: dict[str, Any], device: str = DEVICE) -> None:
    driver, ids, steps = run_engine(model_dir, "bfloat16", device)
    assert driver.runner.kv_caches[0][0].dtype == torch.bfloat16
    hf32 = hf_model(model_dir, torch.float32, device)
    hf16 = hf_model(model_dir, torch.bfloat16, device)
    ours_err = hf_err = 0.0
    ours_top1 = hf_top1 = total = 0
    for rid, n in zip(ids, LENGTHS):
        seq = torch.tensor([driver.tokens[rid][:-1]], device=device)
        with torch.no_grad():
            ref = hf32(seq).logits[0].float().cpu()
            yard = hf16(seq).logits[0].float().cpu()
        for s, logits in enumerate(steps):
            want, got, theirs = ref[n - 1 + s], logits[rid].float().cpu(), yard[n - 1 + s]
            scale = float(want.max() - want.min())
            ours_err += float((got - want).abs().mean()) / scale
            hf_err += float((theirs - want).abs().mean()) / scale
            ours_top1 += int(got.argmax() == want.argmax())
            hf_top1 += int(theirs.argmax() == want.argmax())
            total += 1
    figures.update(mean_err_over_range=ours_err / total, hf_bf16_mean_err_over_range=hf_err / total,
                   top1_agree=ours_top1 / total, hf_bf16_top1_agree=hf_top1 / total)
    assert ours_err <= 2.5 * hf_err, f"mean error {ours_err / total:.4g} vs HF bf16 {hf_err / total:.4g}"
    assert ours_top1 >= hf_top1 - 0.1 * total, f"top-1 {ours_top1}/{total} vs HF bf16 {hf_top1}"


def test_float32_logits_and_greedy_tokens_match_hf(model_dir: Path, figures: dict[str, Any]) -> None:
    check_float32(model_dir, figures)


def test_bfloat16_is_as_close_to_hf_float32_as_hf_bfloat16(model_dir: Path,
                                                           figures: dict[str, Any]) -> None:
    check_bfloat16(model_dir, figures)
