"""Tensor parallelism over gloo on the CPU (issue 15): the model split over M ranks
gives exactly the tokens of one rank, and each rank holds about 1/M of the split weights.

The offline engine runs rank 0 in the test process and spawns the other ranks; the
served stack's ranks are separate workers (``tests/e2e/test_tensor_parallel_stack.py``).
Everything is float32, where a split matmul rounds like the whole one closely enough
that greedy tokens are equal (the sum over ranks reorders additions only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.llm import LLM
from services.worker.loader import load_model
from services.worker.parallel import ShardingError, TensorParallel, shard_sizes
from shared.sampling_params import SamplingParams
from support.checkpoints import make_checkpoint

pytestmark = pytest.mark.slow
SHARED = [3, 4, 5, 6, 7, 8, 9, 10] * 3  # a prefix three prompts share: prefix-cache hits
PROMPTS = [SHARED, SHARED + [11, 12], SHARED + [13], list(range(20, 90)), list(range(100, 117))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def run(model_dir: Path, tp: int, **settings: object) -> tuple[list[list[int]], object]:
    """Greedy tokens of PROMPTS with chunked prefill (32-token budget) and a KV pool small
    enough that sequences are preempted; the scheduler's stats."""
    with LLM(str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=tp,
             block_size=8, num_kv_blocks=28, max_num_batched_tokens=32, **settings) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.stats()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 heads, 2 KV heads; 509 ids: the vocabulary is padded to split it
    return make_checkpoint(tmp_path_factory.mktemp("tp-llama"), "llama", seed=11, vocab_size=509)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tp-qwen2"), "qwen2", seed=12)  # q/k/v bias


@pytest.mark.parametrize("kind,kv_cache_dtype", [("llama", "auto"), ("qwen2", "auto"),
                                                ("llama", "bfloat16")])
def test_two_ranks_give_the_tokens_of_one(kind: str, kv_cache_dtype: str, llama_dir: Path,
                                          qwen2_dir: Path) -> None:
    # each rank's share of the KV heads in bf16 under fp32 too
    model_dir = llama_dir if kind == "llama" else qwen2_dir
    one, _ = run(model_dir, 1, kv_cache_dtype=kv_cache_dtype)
    two, stats = run(model_dir, 2, kv_cache_dtype=kv_cache_dtype)
    assert two == one
    assert all(len(t) == 64 for t in two)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # type: ignore[attr-defined]


def test_more_ranks_than_kv_heads_replicate_them(llama_dir: Path) -> None:
    """4 ranks, 2 KV heads: each KV head lives on two ranks (as vLLM replicates them)."""
    one, _ = run(llama_dir, 1)
    four, _ = run(llama_dir, 4)
    assert four == one


def test_smollm2_split_over_three_ranks_gives_hf_greedy_tokens(smollm2_dir: Path) -> None:
    """9 heads and 3 KV heads over 3 ranks: HF transformers' greedy tokens, exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    expected = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id)
        expected.append(out[0, ids.shape[1]:].tolist())
    del hf
    with LLM(str(smollm2_dir), dtype="float32", device="cpu", tensor_parallel_size=3,
             num_kv_blocks=64) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    # HF stops at EOS; compare the tokens both produced
    assert [g[: len(e)] for g, e in zip(got, expected)] == expected


def test_sizes_that_do_not_split_are_refused_with_the_numbers(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split 4 attention heads"):
        LLM(str(llama_dir), dtype="float32", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ShardingError, match=r"3 KV heads \(neither divisible by 2"):
        shard_sizes(6, 3, 8, 10, TensorParallel(0, 2))
    with pytest.raises(ShardingError, match="intermediate size 9"):
        shard_sizes(4, 2, 9, 10, TensorParallel(0, 2))


def _param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the split tensors, bytes of the replicated ones), each tensor once."""
    split, replicated, seen = 0, 0, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            continue  # a tied lm_head is the embedding
        seen.add(p.data_ptr())
        size = p.numel() * p.element_size()
        if "norm" in name or name.endswith(("o_bias", "down_bias")):
            replicated += size
        else:
            split += size
    return split, replicated


@pytest.mark.parametrize(("model", "ranks"), [("smollm2", 3), ("llama", 2)])
def test_each_rank_holds_a_share_of_the_split_weights(
        model: str, ranks: int, smollm2_dir: Path, llama_dir: Path) -> None:
    """Each rank's resident weights (loaded from only its slices of the checkpoint): the
    split tensors' bytes over M, plus the replicated norms, which are whole everywhere
    (SmolLM2: 135 M parameters, 9 heads, 3 KV heads, a tied 49,152-row embedding)."""
    model_dir = smollm2_dir if model == "smollm2" else llama_dir
    whole_split, whole_replicated = _param_bytes(load_model(model_dir))
    for rank in range(ranks):
        split, replicated = _param_bytes(load_model(model_dir, tp=TensorParallel(rank, ranks)))
        assert replicated == whole_replicated
        assert split == pytest.approx(whole_split / ranks, rel=1e-3), (rank, split, whole_split)
