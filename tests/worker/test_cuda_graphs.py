"""Decode CUDA graphs (services/worker/cuda_graphs.py) and the profiled KV pool
(services/worker/memory_profile.py).

On the CPU the graphs' padded path runs eagerly ("graphs off, same code"): the same
persistent buffers, padding and metadata a graph is captured with. Its greedy tokens
and logits must equal the plain eager path's for every batch size up to past the
largest bucket, with the torch backend and the Triton one (interpreter), and padded
rows must write no KV block. The ``gpu`` tests capture and replay for real.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import cpu_decode
from services.worker import sampler as sampler_module
from services.worker.attention.base import AttentionBackend
from services.worker.attention.torch_backend import CpuAttentionBackend, TorchAttentionBackend
from services.worker.cuda_graphs import (
    DecodeGraphs,
    bucket_for,
    graph_batch_sizes,
    needs_rope_plan,
)
from services.worker.loader import load_model
from services.worker.memory_profile import MemoryProfile, dummy_step, kv_cache_budget
from services.worker.model_runner import ModelRunner
from services.worker.parallel import TensorParallel
from services.worker.runner_builder import RunnerSpec, _num_blocks, _use_cuda_graphs, build_runner
from shared.config import ConfigError, EngineSettings, add_arguments, load_engine_settings
from shared.sampling_params import SamplingParams
from support.checkpoints import make_checkpoint
from support.paged import PagedDriver

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_RUNS = HAS_TRITON and (torch.cuda.is_available()
                              or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="needs triton on CUDA or interpreted")
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON),
                                reason="needs a CUDA device and triton")
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64 (the Triton kernels want a power of two >= 16), 2 query heads per KV head
    return make_checkpoint(tmp_path_factory.mktemp("graphs-llama"), "llama", seed=7,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def triton_backend(**kwargs: int) -> AttentionBackend:
    from services.worker.attention.triton_backend import TritonAttentionBackend

    # tiny tiles and split lengths, so these short sequences take the split-K paths
    return TritonAttentionBackend(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16,
                                  min_tokens_per_split=16, **kwargs)


def make_runner(model_dir: Path, backend: AttentionBackend, graph_max_bs: int | None,
                device: str = "cpu", capture: bool = False) -> ModelRunner:
    model = load_model(model_dir).to(device)
    runner = ModelRunner(model, backend, num_blocks=64, block_size=BLOCK_SIZE, device=device)
    if graph_max_bs is not None:
        runner.enable_decode_graphs(graph_max_bs, MAX_MODEL_LEN, capture=capture)
    return runner


def spy_buckets(graphs: DecodeGraphs) -> list[int]:
    """The bucket of every step the graphs ran (wraps ``run``)."""
    seen: list[int] = []
    run = graphs.run

    def counted(input_ids, *args):  # type: ignore[no-untyped-def]
        seen.append(bucket_for(len(input_ids), graphs.sizes))  # type: ignore[arg-type]
        return run(input_ids, *args)

    graphs.run = counted  # type: ignore[method-assign]
    return seen


def lockstep(drivers: list[PagedDriver], num_tokens: dict[str, int]) -> list[dict[str, torch.Tensor]]:
    """One step on every driver; each one's logits by request."""
    return [d.step(num_tokens)[1] for d in drivers]


def run_batches(model_dir: Path, make_backend, graph_max_bs: int, batch_sizes: list[int],  # type: ignore[no-untyped-def]
                device: str = "cpu", capture: bool = False):  # type: ignore[no-untyped-def]
    """Eager and padded-path runners side by side: prompts of mixed lengths (on, one past
    and inside block boundaries) prefilled eagerly, then decode batches of each of
    ``batch_sizes`` (the last n sequences: mixed context lengths), twice over.

    Returns each runner's outputs, every step's logits (per runner) with whether they
    must be bit-identical (no step so far padded a row: a GEMM's rows round differently
    with the row count, in MKL, oneDNN and cuBLAS alike, e.g. ~1e-6 between a row of a
    3-row and of a 4-row product, and the K/V such a step writes carry it into later
    steps), and the bucket of every step the graphs ran."""
    eager = make_runner(model_dir, make_backend(), None, device)
    padded = make_runner(model_dir, make_backend(), graph_max_bs, device, capture)
    assert padded.graphs is not None
    buckets, sizes = spy_buckets(padded.graphs), padded.graphs.sizes
    drivers = [PagedDriver(eager, seed=3), PagedDriver(padded, seed=3)]
    gen = torch.Generator().manual_seed(11)
    # the last (alone in a batch of 1) spans 3 key tiles: a split-K factor of 2 or 4
    lengths = [16, 17, 5, 1, 33, 9, 64, 2][: max(batch_sizes) - 1] + [40]
    names = [f"r{i}" for i in range(len(lengths))]
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]
    for d in drivers:
        for name, prompt in zip(names, prompts):
            d.add(name, prompt)
    steps = [(lockstep(drivers, dict(zip(names, lengths))), True)]
    exact = True
    for _ in range(2):
        for n in batch_sizes:
            exact = exact and bucket_for(n, sizes) in (None, n)
            steps.append((lockstep(drivers, {r: 1 for r in names[-n:]}), exact))
    outputs = [{r: d.output(r) for r in names} for d in drivers]
    return outputs, steps, buckets


def assert_logits_match(steps, atol: float = 0.0, atol_padded: float = 5e-5) -> None:  # type: ignore[no-untyped-def]
    """Within ``atol`` until a step padded a row, then within ``atol_padded``."""
    for i, ((a, b), exact) in enumerate(steps):
        assert a.keys() == b.keys()
        for rid in a:
            diff = float((a[rid].cpu() - b[rid].cpu()).abs().max())
            limit = atol if exact else max(atol, atol_padded)
            assert diff <= limit, f"step {i} {rid}: logits differ by {diff:.3g}"


# -- buckets -----------------------------------------------------------------------------------


def test_graph_batch_sizes_and_bucket_selection() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b % 8 == 0 for b in sizes[3:])
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 255, 256)] == [
        1, 2, 4, 8, 8, 16, 24, 256, 256]
    assert bucket_for(257, sizes) is None
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


# -- the padded path against the eager one, on the CPU ------------------------------------------


def test_padded_path_bit_identical_when_batches_fill_buckets(model_dir: Path) -> None:
    # the buffers, staging, metadata and padding bookkeeping change no bit
    outputs, steps, buckets = run_batches(model_dir, TorchAttentionBackend, 6, [1, 2, 4, 6, 7])
    assert outputs[0] == outputs[1]
    assert all(exact for _, exact in steps)
    assert_logits_match(steps)
    assert buckets == [1, 2, 4, 6] * 2  # 7 sequences: past the largest bucket, eager


def test_padded_path_matches_eager_torch_backend(model_dir: Path) -> None:
    outputs, steps, buckets = run_batches(model_dir, TorchAttentionBackend, 6, list(range(1, 8)))
    assert outputs[0] == outputs[1]
    assert_logits_match(steps)
    assert buckets == [1, 2, 4, 4, 6, 6] * 2


def test_padded_path_matches_eager_cpu_backend(model_dir: Path) -> None:
    if not cpu_decode.available():
        pytest.skip("the C++ decode kernel does not build here")
    outputs, steps, buckets = run_batches(model_dir, CpuAttentionBackend, 4, list(range(1, 6)))
    assert outputs[0] == outputs[1]
    assert_logits_match(steps)
    assert buckets == [1, 2, 4, 4] * 2


@needs_triton
def test_padded_path_matches_eager_triton_backend_fixed_splits(model_dir: Path) -> None:
    # the same forced split-K factor on both paths: the same kernels per row
    outputs, steps, buckets = run_batches(model_dir, lambda: triton_backend(num_splits=2), 4,
                                          list(range(1, 6)))
    assert outputs[0] == outputs[1]
    assert_logits_match(steps)
    assert buckets == [1, 2, 4, 4] * 2


@needs_triton
def test_padded_path_matches_eager_triton_backend_graph_splits(model_dir: Path) -> None:
    # the graph path splits for max_model_len, the eager one for the step's longest
    # sequence: alone, the 40-token one gets 4 splits (one empty) against 2 (the
    # interpreter's 4 "SMs", 16-key minimum), so logits agree up to split-K rounding
    outputs, steps, buckets = run_batches(model_dir, triton_backend, 4, list(range(1, 6)))
    assert outputs[0] == outputs[1]
    assert_logits_match(steps, atol=5e-5)
    assert buckets == [1, 2, 4, 4] * 2


def test_steps_the_graphs_do_not_take(model_dir: Path) -> None:
    """Prefill chunks and decode steps holding a prompt-logprobs request run eagerly; a
    decode step of the same runner without one then takes the graphs."""
    runner = make_runner(model_dir, TorchAttentionBackend(), 4)
    assert runner.graphs is not None
    buckets = spy_buckets(runner.graphs)
    driver = PagedDriver(runner, seed=1)
    driver.add("a", list(range(3, 20)))
    driver.add("p", list(range(3, 12)), SamplingParams(temperature=0.0, max_tokens=None,
                                                       prompt_logprobs=2))
    driver.step({"a": 17, "p": 4})  # prefill and a chunk: eager
    driver.step({"a": 1, "p": 1})  # one-token prompt chunk of a prompt-logprobs request
    assert buckets == []
    driver.step({"a": 1})
    assert buckets == [1]


def eager_and_padded(model_dir: Path, graph_max_bs: int,
                     seed: int = 0) -> tuple[list[PagedDriver], list[int]]:
    """Drivers of an eager runner and of a padded-path one (torch backend, graphs up to
    ``graph_max_bs``), and the bucket of every step the graphs run."""
    eager = make_runner(model_dir, TorchAttentionBackend(), None)
    padded = make_runner(model_dir, TorchAttentionBackend(), graph_max_bs)
    assert padded.graphs is not None
    buckets = spy_buckets(padded.graphs)
    return [PagedDriver(eager, seed=seed), PagedDriver(padded, seed=seed)], buckets


def count_sampler_argmax(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every argmax the sampler itself takes (the graphs' own is not counted)."""
    seen: list[int] = []
    argmax_rows = sampler_module.argmax_rows

    def counted(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return argmax_rows(x)

    monkeypatch.setattr(sampler_module, "argmax_rows", counted)
    return seen


def test_plain_greedy_decode_takes_the_graphs_argmax(model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain greedy decode step takes its tokens from the graph (the LM head and the
    argmax run inside it): the sampler computes none, and the tokens and logits are the
    eager runner's."""
    drivers, buckets = eager_and_padded(model_dir, 4, seed=2)
    for d in drivers:
        d.add("a", list(range(3, 20)))
        d.add("b", list(range(30, 41)))
    lockstep(drivers, {"a": 17, "b": 11})  # prefill: eager on both
    seen = count_sampler_argmax(monkeypatch)
    for _ in range(3):
        eager_logits, padded_logits = lockstep(drivers, {"a": 1, "b": 1})
        for rid in ("a", "b"):  # batch 2 fills bucket 2: no padding, the same bits
            assert torch.equal(eager_logits[rid], padded_logits[rid])
    assert buckets == [2, 2, 2]
    assert seen == [2, 2, 2]  # the eager runner's argmax only
    assert drivers[0].output("a") == drivers[1].output("a")
    assert drivers[0].output("b") == drivers[1].output("b")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=None, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=None, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, max_tokens=None, seed=5, top_k=20),
], ids=["logprobs", "penalty", "seeded-random"])
def test_other_decode_steps_sample_the_graphs_logits(model_dir: Path,
                                                     params: SamplingParams) -> None:
    """A decode step that is not plain greedy samples eagerly from the graph's logits:
    the same tokens and logprobs as the eager runner."""
    drivers, buckets = eager_and_padded(model_dir, 2, seed=4)
    for d in drivers:
        d.add("a", list(range(3, 20)), params)
        d.add("g", list(range(50, 60)))  # plain greedy beside it
    results = [d.step({"a": 17, "g": 10})[0] for d in drivers]
    for _ in range(4):
        results = [d.step({"a": 1, "g": 1})[0] for d in drivers]
        assert results[0].sampled_token_ids == results[1].sampled_token_ids
        assert results[0].logprobs == results[1].logprobs
    assert buckets == [2] * 4
    for rid in ("a", "g"):
        assert drivers[0].output(rid) == drivers[1].output(rid)


def test_length_dependent_rope_past_threshold_runs_eagerly(tmp_path: Path) -> None:
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    path = make_checkpoint(tmp_path, "llama", seed=2, rope_scaling=scaling,
                           max_position_embeddings=32)
    assert not needs_rope_plan(load_model(path), 32) and needs_rope_plan(load_model(path), 33)
    static = load_model(make_checkpoint(tmp_path / "static", "llama", seed=2))
    assert not needs_rope_plan(static, 10**6)
    drivers, buckets = eager_and_padded(path, 4)
    for d in drivers:
        d.add("a", list(range(3, 33)))  # 30 tokens
        d.add("b", list(range(40, 50)))
    lockstep(drivers, {"a": 30, "b": 10})
    for _ in range(4):  # "a" reaches 31, 32 (graphs), then 33, 34 (past 32: its plan)
        lockstep(drivers, {"a": 1, "b": 1})
    assert buckets == [2, 2]
    assert drivers[0].output("a") == drivers[1].output("a")


# -- padded rows write no block -----------------------------------------------------------------


def _backends() -> list[pytest.param]:
    params = [pytest.param(TorchAttentionBackend, id="torch")]
    if cpu_decode.available():
        params.append(pytest.param(CpuAttentionBackend, id="cpu"))
    if TRITON_RUNS:
        params.append(pytest.param(lambda: triton_backend(), id="triton"))
    return params


@pytest.mark.parametrize("make_backend", _backends())
def test_padded_rows_write_no_block(model_dir: Path, make_backend) -> None:  # type: ignore[no-untyped-def]
    runner = make_runner(model_dir, make_backend(), 8)
    graphs = runner.graphs
    assert graphs is not None
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:  # every slot holds something a write would change
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    # 3 sequences (bucket 4) whose block tables start at block 0, the block padded rows read
    seq_lens = np.array([5, 20, 1], dtype=np.int64)
    tables = np.array([[0, 9], [3, 4], [7, 0]], dtype=np.int64)
    slots = np.array([0 * 16 + 4, 4 * 16 + 3, 7 * 16 + 0], dtype=np.int64)
    out = graphs.run(np.array([5, 6, 7]), seq_lens - 1, slots, seq_lens, tables)
    assert out.logits.shape[0] == out.argmax.shape[0] == 4 and torch.isfinite(out.logits).all()
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        for old, new in ((k0, k1), (v0, v1)):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert changed == sorted(slots.tolist()), f"slots written: {changed}"


# -- settings, and no capture off CUDA ----------------------------------------------------------


def test_settings_flags_and_validation() -> None:
    engine = load_engine_settings({}, {})
    assert (engine.enforce_eager, engine.cuda_graph_max_batch_size,
            engine.gpu_memory_utilization) == (False, None, 0.9)
    engine = load_engine_settings({}, {"PAGODA_ENFORCE_EAGER": "1",
                                       "PAGODA_CUDA_GRAPH_MAX_BATCH_SIZE": "64",
                                       "PAGODA_GPU_MEMORY_UTILIZATION": "0.5"})
    spec = RunnerSpec.from_settings(engine)
    assert (spec.enforce_eager, spec.cuda_graph_max_batch_size,
            spec.gpu_memory_utilization) == (True, 64, 0.5)
    assert spec.graph_max_batch_size == 64
    assert RunnerSpec(max_num_seqs=16).graph_max_batch_size == 16
    assert RunnerSpec(max_num_seqs=1024).graph_max_batch_size == 256
    for bad in ({"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5},
                {"gpu_memory_utilization": float("nan")}, {"cuda_graph_max_batch_size": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            EngineSettings(**bad)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_arguments(parser, groups=("engine",))
    args = parser.parse_args(["--enforce-eager", "--cuda-graph-max-batch-size", "32",
                              "--gpu-memory-utilization", "0.8"])
    assert (args.enforce_eager, args.cuda_graph_max_batch_size,
            args.gpu_memory_utilization) == (True, 32, 0.8)


def test_no_capture_on_cpu_or_with_enforce_eager(model_dir: Path) -> None:
    cuda = torch.device("cuda")
    capturable = triton_backend() if TRITON_RUNS else None
    if capturable is not None:
        assert _use_cuda_graphs(RunnerSpec(), cuda, TensorParallel(), capturable)
        assert not _use_cuda_graphs(RunnerSpec(enforce_eager=True), cuda, TensorParallel(),
                                    capturable)
        assert not _use_cuda_graphs(RunnerSpec(), cuda, TensorParallel(0, 2), capturable)
        assert not _use_cuda_graphs(RunnerSpec(), torch.device("cpu"), TensorParallel(),
                                    capturable)
    assert not _use_cuda_graphs(RunnerSpec(), cuda, TensorParallel(), TorchAttentionBackend())
    built = build_runner(model_dir, RunnerSpec(device="cpu", dtype="float32", num_kv_blocks=8))
    assert built.runner.graphs is None  # the CPU runs eagerly, no padded path
    runner = make_runner(model_dir, TorchAttentionBackend(), 4)
    assert runner.graphs is not None and runner.graphs.captured == []
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.graphs.capture()
    two_ranks = SimpleNamespace(tp=TensorParallel(0, 2))  # what the check reads
    with pytest.raises(ValueError, match="single rank"):
        ModelRunner.enable_decode_graphs(two_ranks, 4, MAX_MODEL_LEN, capture=False)  # type: ignore[arg-type]


# -- KV pool sizing -----------------------------------------------------------------------------


def test_kv_cache_budget_arithmetic() -> None:
    gib = 2**30
    profile = MemoryProfile(total=80 * gib, free=60 * gib, weights=16 * gib,
                            peak_activations=2 * gib, non_torch=gib // 2)
    # 72 - 16 - 2 - 0.5 - 0.5 = 53 GiB
    assert kv_cache_budget(profile, 0.9, gib // 2) == 53 * gib
    # capped by the free memory, less the activations every large step needs again
    assert kv_cache_budget(profile, 1.0, 0) == 58 * gib
    busy = MemoryProfile(total=80 * gib, free=20 * gib, weights=16 * gib,
                         peak_activations=2 * gib, non_torch=0)  # another process's 40 GiB
    assert kv_cache_budget(busy, 0.9, gib) == 17 * gib
    assert kv_cache_budget(profile, 0.2, 0) == 0  # the weights alone exceed 16 GiB


def test_kv_pool_size_from_settings_or_profiled(model_dir: Path) -> None:
    model = load_model(model_dir)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _num_blocks(model, RunnerSpec(), torch.float32, cuda) is None  # profiled
    assert _num_blocks(model, RunnerSpec(num_kv_blocks=10), torch.float32, cuda) == 10
    # 2 layers x K and V x 16 tokens x 2 heads x 64 x 4 bytes = 32 KiB a block
    assert _num_blocks(model, RunnerSpec(kv_cache_bytes=2**20), torch.float32, cuda) == 32
    assert _num_blocks(model, RunnerSpec(), torch.float32, cpu) == 2 * 2**30 // 2**15


@pytest.mark.parametrize(("tokens", "seqs"), [(64, 8), (7, 16), (300, 2)])
def test_profiling_step_runs_on_cpu(model_dir: Path, tokens: int, seqs: int) -> None:
    model = load_model(model_dir)
    dummy_step(model, TorchAttentionBackend(), tokens, seqs, MAX_MODEL_LEN, BLOCK_SIZE,
               torch.float32, torch.device("cpu"))


# -- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_captured_graphs_match_eager_on_cuda(model_dir: Path) -> None:
    outputs, steps, buckets = run_batches(model_dir, triton_backend, 4, list(range(1, 6)),
                                          device="cuda", capture=True)
    assert outputs[0] == outputs[1]
    # split-K differs (max_model_len vs the step), and cuBLAS rounds by row count
    assert_logits_match(steps, atol=1e-4, atol_padded=1e-4)
    assert buckets == [1, 2, 4, 4] * 2


@pytest.mark.gpu
@needs_cuda
def test_capture_then_replay_equals_padded_eager_on_cuda(model_dir: Path) -> None:
    runner = make_runner(model_dir, triton_backend(), 8, "cuda", capture=True)
    graphs = runner.graphs
    assert graphs is not None and graphs.captured == [1, 2, 4, 8]
    ids, lens = np.array([5, 6, 7]), np.array([5, 20, 1], dtype=np.int64)
    tables = np.array([[1, 9], [3, 4], [7, 0]], dtype=np.int64)
    slots = np.array([1 * 16 + 4, 4 * 16 + 3, 7 * 16], dtype=np.int64)
    replayed = graphs.run(ids, lens - 1, slots, lens, tables)
    replayed_logits, replayed_argmax = replayed.logits.clone(), replayed.argmax.clone()
    graphs._graphs.clear()  # the same buffers and metadata, eagerly
    eager = graphs.run(ids, lens - 1, slots, lens, tables)
    torch.testing.assert_close(replayed_logits[:3], eager.logits[:3], rtol=0, atol=1e-4)
    assert torch.equal(replayed_argmax[:3], eager.logits[:3].argmax(-1))


@pytest.mark.gpu
@needs_cuda
def test_kv_pool_is_profiled_on_cuda(model_dir: Path) -> None:
    from services.worker.memory_profile import cuda_used, profile_memory

    model = load_model(model_dir).to("cuda")
    dev = torch.device("cuda")
    profile = profile_memory(lambda: dummy_step(model, TorchAttentionBackend(), 512, 16,
                                                MAX_MODEL_LEN, BLOCK_SIZE, torch.float32, dev),
                             dev, cuda_used(dev))
    assert profile.weights > 0 and profile.peak_activations > 0
    assert 0 < profile.free <= profile.total
    spec = RunnerSpec(device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                      max_num_seqs=16, max_num_batched_tokens=256)
    built = build_runner(model_dir, spec)
    assert built.num_blocks > 2 and built.runner.graphs is not None
    assert built.runner.graphs.captured == [1, 2, 4, 8, 16]
