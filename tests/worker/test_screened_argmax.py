"""The screened greedy LM head (services/worker/layers/screened_argmax.py) against the
full fp32 head it stands in for.

Oracle: ``argmax_rows`` of the full fp32 head's logits (cpu_gemm, as the model computes
them), which the screened tokens must equal exactly, ties included (the first index).
The two facts the exactness rests on are checked on their own: the fp32 tiles give a
column the same bits whatever other columns are packed beside it, and every bf16 score
lies within the bound of its fp32 logit. Through a real ModelRunner, plain greedy steps
take the screened head and give the tokens of a runner without it; a step with a row that
samples or asks for logprobs takes the full head. The class is built directly here, so
the tests run on any CPU (``build`` enables it only where bf16 tiles use AVX512-BF16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_fused, cpu_gemm
from services.worker.attention import get_attention_backend
from services.worker.layers import screened_argmax
from services.worker.layers.linear import PackedWeight, linear, pack_cpu_linears
from services.worker.layers.screened_argmax import ScreenedArgmax
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from support.paged import PagedDriver

pytestmark = pytest.mark.skipif(not (cpu_gemm.available() and cpu_fused.available()),
                                reason="the C++ CPU extensions do not build here")


def gemm_packed(weight: torch.Tensor) -> PackedWeight:
    return PackedWeight(cpu_gemm.pack(weight), weight.shape[0], True)


def head(vocab: int, hidden: int, seed: int) -> torch.Tensor:
    """A random fp32 head whose row norms vary over two orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, vocab)[torch.randperm(vocab, generator=gen)]
    return torch.randn(vocab, hidden, generator=gen) * scale[:, None] * 0.05


def full_argmax(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return cpu_fused.argmax_rows(linear(hidden, weight, None, gemm_packed(weight)))


@pytest.mark.parametrize("rows", [1, 7, 45, 64])
def test_a_column_has_the_same_bits_whatever_columns_are_packed_beside_it(rows: int) -> None:
    weight = head(3000, 576, seed=1)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    full = cpu_gemm.linear(x, cpu_gemm.pack(weight), 3000, None)
    gen = torch.Generator().manual_seed(2)
    for size in (1, 5, 47, 48, 49, 300):
        cols = torch.randperm(3000, generator=gen)[:size].sort().values
        part = cpu_gemm.linear(x, cpu_gemm.pack(weight.index_select(0, cols)), size, None)
        assert torch.equal(part, full.index_select(1, cols)), f"{size} columns"


@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])
def test_every_bf16_score_lies_within_its_bound(scale: float) -> None:
    weight = head(4000, 576, seed=3)
    screen = ScreenedArgmax(weight, gemm_packed(weight))
    h = torch.randn(33, 576, generator=torch.Generator().manual_seed(4)) * scale
    h[0] = h[0].abs()  # a row whose logits all lean one way
    exact = linear(h, weight, None, gemm_packed(weight)).double()
    bf16 = cpu_gemm.linear(h.bfloat16(), screen.bf16_packed, 4000, None).double()
    bound = screen.bounds(h, h.bfloat16())[:, None] + screened_argmax._REL * bf16.abs()
    assert ((bf16 - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 8, 45, 64])
def test_tokens_are_the_full_heads_argmax(rows: int) -> None:
    weight = head(5000, 576, seed=5)
    screen = ScreenedArgmax(weight, gemm_packed(weight))
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        # hidden states near some head rows: a few logits stand out, as in a real model
        picks = torch.randint(0, 5000, (rows,), generator=gen)
        h = weight.index_select(0, picks) * 20 + torch.randn(rows, 576, generator=gen)
        got = screen(h)
        assert got is not None
        assert torch.equal(got, full_argmax(weight, h))


def test_ties_go_to_the_first_index_and_near_ties_are_resolved_in_fp32() -> None:
    weight = head(2000, 576, seed=7)
    weight[900] = weight[40]  # exact ties with row 40: the same bits, the same logit
    weight[1500] = weight[40]
    weight[41] = weight[40] * (1 + 2.0**-20)  # a hair above row 40 where h . w40 > 0
    weight[39] = weight[40] * (1 - 2.0**-20)  # a hair below
    screen = ScreenedArgmax(weight, gemm_packed(weight))
    h = weight[40:41] * 40
    assert full_argmax(weight, h).item() == 41
    assert screen(h).tolist() == [41]
    weight[41] = weight[39]  # now 40, 900 and 1500 tie at the top: the first one wins
    screen = ScreenedArgmax(weight, gemm_packed(weight))
    assert full_argmax(weight, h).item() == 40
    assert screen(h).tolist() == [40]


def near_zero_head(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [1, 64], a [4096, 64] head) whose rows are all but orthogonal to h, 24 of them
    with logits within 0.05 of zero, the rest near -10."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, 64, generator=gen)
    unit = h[0] / h[0].norm()
    rows = torch.randn(4096, 64, generator=gen)
    rows -= (rows @ unit)[:, None] * unit  # orthogonal to h
    logits = torch.full((4096,), -10.0)
    logits[torch.randperm(4096, generator=gen)[:24]] = torch.rand(24, generator=gen) * -0.05
    return h, rows + (logits / h[0].norm())[:, None] * unit


def test_a_column_the_bf16_head_ranks_below_another_is_still_the_fp32_argmax() -> None:
    # near_zero_head: rounding w and h to bf16 moves the top scores more than they differ,
    # and for some seeds the bf16 head strictly prefers another column; only the fp32
    # recomputation of the kept columns finds the argmax
    found = 0
    for seed in range(40):
        h, rows = near_zero_head(seed)
        screen = ScreenedArgmax(rows, gemm_packed(rows))
        want = full_argmax(rows, h)
        bf16 = cpu_gemm.linear(h.bfloat16(), screen.bf16_packed, 4096, None)
        if bf16[0, want.item()] < bf16.max():  # the case this test is about
            found += 1
            assert torch.equal(screen(h), want)
    assert found >= 5


def test_falls_back_to_the_full_head() -> None:
    weight = head(800, 64, seed=8)
    screen = ScreenedArgmax(weight, gemm_packed(weight))
    h = torch.randn(3, 64)
    for bad in (float("nan"), float("inf")):
        broken = h.clone()
        broken[1, 5] = bad
        assert screen(broken) is None
    assert screen(torch.zeros(2, 64)) is None  # every logit 0: every column kept
    assert screen(torch.empty(0, 64)) is None
    with pytest.raises(ValueError):
        screen(h.bfloat16())


def test_a_screen_that_keeps_too_much_too_often_turns_itself_off() -> None:
    flat = torch.zeros(500, 64)  # every logit 0: every call keeps every column
    screen = ScreenedArgmax(flat, gemm_packed(flat))
    h = torch.randn(2, 64)
    for _ in range(screened_argmax.PROBATION_CALLS):
        assert screen.active
        assert screen(h) is None
    assert not screen.active
    weight = head(500, 64, seed=12)  # a head it works for stays on
    screen = ScreenedArgmax(weight, gemm_packed(weight))
    for _ in range(screened_argmax.PROBATION_CALLS + 1):
        assert screen(weight[:3] * 20) is not None
    assert screen.active


def test_build_applies_to_finite_fp32_heads_packed_for_cpu_gemm_only() -> None:
    weight = head(300, 64, seed=9)
    native_bf16 = cpu_gemm.tile_paths().get(torch.bfloat16) == "avx512"
    assert (ScreenedArgmax.build(weight, gemm_packed(weight)) is not None) == native_bf16
    assert ScreenedArgmax.build(weight, None) is None
    onednn_like = PackedWeight(weight, 300, False)
    assert ScreenedArgmax.build(weight, onednn_like) is None
    bf16 = weight.bfloat16()
    assert ScreenedArgmax.build(bf16, gemm_packed(bf16)) is None
    broken = weight.clone()
    broken[7, 3] = float("inf")
    assert ScreenedArgmax.build(broken, gemm_packed(broken)) is None
    with pytest.raises(ValueError):
        ScreenedArgmax(bf16, gemm_packed(bf16))


def runner_for(model_dir: Path, screened: bool) -> tuple[ModelRunner, list[bool]]:
    """A runner of the fp32 model, with the screened head or without; and a list that
    records, per call of the head, whether it gave the tokens."""
    model = load_model(model_dir, torch.float32)
    pack_cpu_linears(model, kernel="cpu_gemm")
    calls: list[bool] = []
    if screened:
        inner = ScreenedArgmax(model.lm_head_weight, model.lm_head_weight_packed)

        def counted(hidden: torch.Tensor) -> torch.Tensor | None:
            tokens = inner(hidden)
            calls.append(tokens is not None)
            return tokens

        model.screened_argmax = counted  # type: ignore[assignment]
    runner = ModelRunner(model, get_attention_backend(torch.device("cpu"), None), num_blocks=64,
                         block_size=16, kv_dtype=torch.float32)
    return runner, calls


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_steps_through_a_runner_give_the_full_heads_tokens(
    model_fixture: str, request: pytest.FixtureRequest,
) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    (plain, _), (screened, calls) = runner_for(model_dir, False), runner_for(model_dir, True)
    drivers = [PagedDriver(r, seed=4, keep_logits=False) for r in (plain, screened)]
    gen = torch.Generator().manual_seed(5)
    sampling = SamplingParams(temperature=0.8, seed=11, max_tokens=None)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=2, max_tokens=None)
    prompts = {r: torch.randint(3, 500, (n,), generator=gen).tolist()
               for r, n in {"a": 6, "b": 21, "c": 9, "s": 5, "l": 4}.items()}
    for d in drivers:
        for rid in "abc":
            d.add(rid, prompts[rid])
        d.add("s", prompts["s"], sampling)
        d.add("l", prompts["l"], with_logprobs)
    # greedy prefills (b chunked), a mixed step, greedy decodes; then steps with a
    # sampling row and a logprobs row: those take the full head
    steps = [{"a": 6, "b": 10, "c": 9}, {"a": 1, "b": 11, "c": 1}]
    steps += [{"a": 1, "b": 1, "c": 1}] * 8
    steps += [{"a": 1, "s": 5}, {"a": 1, "s": 1}, {"c": 1, "l": 4}, {"b": 1, "c": 1}]
    for step in steps:
        (want, _), (got, _) = (d.step(step) for d in drivers)
        assert got.sampled_token_ids == want.sampled_token_ids, step
        assert got.logprobs == want.logprobs
    for rid in "abcsl":
        assert drivers[0].output(rid) == drivers[1].output(rid)
    # every greedy-only step sampling rows went through the head (the chunk of b alone
    # samples nothing), and gave its tokens
    assert calls == [True] * 11
