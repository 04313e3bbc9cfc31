"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed every step.

A decode step launches a dozen kernels per layer for a handful of tokens, so on a GPU
its time goes to launching them; a graph replays the whole forward in one launch.
Adapted idea: vLLM's ``capture_model`` and cudagraph batch sizes, SGLang's
``cuda_graph_runner.py``.

- Buckets (``graph_batch_sizes``): 1, 2, 4, 8, then every multiple of 8 up to the
  largest (by default min(max_num_seqs, 256)); a step of n sequences runs the smallest
  bucket >= n, its rows padded.
- Inputs live in persistent buffers sized for the largest bucket: input_ids, positions,
  slot_mapping, seq_lens, block_tables [max_bs, max_blocks_per_seq of max_model_len],
  query_start_loc (0..max_bs: one token a row, never rewritten). A step's numpy arrays
  go into host staging buffers (pinned on CUDA), then asynchronously into them.
- Padded rows are harmless: slot -1, which every cache write skips (the Triton kernel,
  the C++ one, the torch reference), so no block is written and the pool gives up no
  scratch block; seq_len 1 over block 0, one key read whose result is dropped (a
  seq_len of 0 would leave the split-K reduce without a non-empty split).
- Output (``DecodeOutput``): each graph ends with the LM head and the argmax of every
  row, so a step that is plain greedy (no temperature, penalty, bias, min_tokens,
  logprobs or grammar: ``SamplingMetadata.is_plain_greedy``) takes its tokens from the
  graph and launches nothing more; any other step samples eagerly from the graph's
  logits. Every decode row samples, so the head costs no more than the eager one (the
  padded rows aside). Both are views of two persistent buffers ([max bucket, vocab]
  fp32 logits, [max bucket] tokens) that every step rewrites: the runner reads or
  copies them before the next.
- Attention backends are captured only if ``supports_cuda_graphs``; each metadata
  built here goes through ``AttentionBackend.prepare_graph`` first (Triton: the decode
  split-K factor fixed from max_model_len instead of the step's longest sequence).

With no graph captured (the CPU, tests) the same padded path runs eagerly: the buffers,
padding and metadata a graph is captured with, so all of it is tested on the CPU;
``capture`` itself is CUDA only. The runner (``ModelRunner._graph_step``) sends a step
here only when it is decode-only, fits the largest bucket, has no prompt logprobs and
needs no per-step rope plan (``needs_rope_plan``), on a single rank: with tensor
parallelism the graphs would capture NCCL collectives (left for later).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.models.llama import KVCache, LlamaForCausalLM
from services.worker.sampler import argmax_rows

DEFAULT_MAX_BATCH_SIZE = 256
PAD_SLOT = -1  # the cache-write slot of a padded row: skipped


@dataclass(frozen=True)
class DecodeOutput:
    """What a decode step leaves, [bucket] rows: the step's rows first, then padding."""

    logits: torch.Tensor  # [bucket, vocab] fp32, as the model's compute_logits
    argmax: torch.Tensor  # [bucket] int64: each row's greedy token, as the sampler's argmax


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, 16, 24, ... up to and including ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4) if s < max_batch_size] + list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` rows; None past the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def needs_rope_plan(model: LlamaForCausalLM, max_seq_len: int) -> bool:
    """Whether a step whose longest sequence is ``max_seq_len`` rotates through a per-step
    plan (``dynamic`` / ``longrope`` past their threshold), which a graph cannot replay:
    decided on the host from the rotary's threshold, as its ``plan`` decides."""
    threshold = model.rotary.plan_threshold
    return threshold is not None and max_seq_len > threshold


class DecodeGraphs:
    """The padded decode path of one runner: its persistent buffers, and a CUDA graph per
    bucket once ``capture`` ran (until then, or on a CPU, the same path eagerly)."""

    def __init__(
        self, model: LlamaForCausalLM, backend: AttentionBackend, kv_caches: list[KVCache],
        max_batch_size: int, max_model_len: int, block_size: int, device: torch.device,
    ) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.device = torch.device(device)
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        n, w, dev = self.max_batch_size, self.max_blocks_per_seq, self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # every bucket's output: views of these (per-bucket tensors of the graph pool would
        # stay alive side by side, 33 buckets of [bucket, vocab] fp32 logits)
        self.logits = torch.zeros(n, model.config.vocab_size, dtype=torch.float32, device=dev)
        self.argmax = torch.zeros(n, dtype=torch.int64, device=dev)
        # host staging, pinned on CUDA so the copies are asynchronous; the block tables
        # flat, so a step's [bucket, its widest row] is one dense block
        pin = dev.type == "cuda"
        self._h_ids = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._h_positions = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._h_slots = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._h_seq_lens = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        self._h_tables = torch.zeros(n * w, dtype=torch.int32, pin_memory=pin)
        # recorded after each step's copies: the staging buffers are free once it passed
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, DecodeOutput] = {}  # bucket -> what its graph writes

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def fits(self, num_seqs: int, num_block_cols: int) -> bool:
        return num_seqs <= self.max_batch_size and num_block_cols <= self.max_blocks_per_seq

    def run(
        self,
        input_ids: np.ndarray,  # [n] int64, one token per sequence
        positions: np.ndarray,  # [n] int64
        slot_mapping: np.ndarray,  # [n] int64
        seq_lens: np.ndarray,  # [n] int64, after this step
        block_tables: np.ndarray,  # [n, cols] int, cols <= max_blocks_per_seq
    ) -> DecodeOutput:  # row i < n is sequence i's, the rest padding
        """One decode step: replayed from its bucket's graph if captured, else eagerly."""
        n = len(input_ids)
        bucket = bucket_for(n, self.sizes)
        if bucket is None or not self.fits(n, block_tables.shape[1]):
            raise ValueError(f"{n} sequences, {block_tables.shape[1]} blocks each do not fit "
                             f"the decode graphs ({self.max_batch_size} x {self.max_blocks_per_seq})")
        self._stage(bucket, input_ids, positions, slot_mapping, seq_lens, block_tables)
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            return self._outputs[bucket]
        return self._forward(bucket, seq_lens.tolist() + [1] * (bucket - n))

    def _stage(self, bucket: int, input_ids: np.ndarray, positions: np.ndarray,
               slot_mapping: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray) -> None:
        """The step's rows, then padding up to ``bucket``, into the device buffers."""
        n, cols = block_tables.shape
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the staging
        for host, rows, pad in ((self._h_ids, input_ids, 0), (self._h_positions, positions, 0),
                                (self._h_slots, slot_mapping, PAD_SLOT),
                                (self._h_seq_lens, seq_lens, 1)):
            view = host.numpy()
            view[:n] = rows
            view[n:bucket] = pad
        tables = self._h_tables[: bucket * cols].view(bucket, cols)
        tables.numpy()[:n] = block_tables
        tables.numpy()[n:] = 0  # padded rows read block 0; columns past cols are never read
        for dst, src in ((self.input_ids, self._h_ids), (self.positions, self._h_positions),
                         (self.slot_mapping, self._h_slots), (self.seq_lens, self._h_seq_lens)):
            dst[:bucket].copy_(src[:bucket], non_blocking=True)
        self.block_tables[:bucket, :cols].copy_(tables, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))

    def _forward(self, bucket: int, seq_lens_host: list[int]) -> DecodeOutput:
        """The model, its LM head and the argmax over the first ``bucket`` rows of the
        buffers (what a graph holds)."""
        meta = AttentionMetadata(
            num_tokens=bucket,
            num_decodes=bucket,
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # a bound, valid for every replay
            query_start_loc_host=list(range(bucket + 1)),
            seq_lens_host=seq_lens_host,  # true when eager; capture-time dummies in a graph
        )
        self.backend.prepare_graph(meta, self.max_model_len)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches,
                            meta, self.backend)
        logits = self.model.compute_logits(hidden, out=self.logits[:bucket])
        argmax = self.argmax[:bucket]
        argmax.copy_(argmax_rows(logits))
        return DecodeOutput(logits, argmax)

    @torch.inference_mode()
    def capture(self) -> None:
        """A graph per bucket, the largest first: the smaller ones then reuse its memory
        in the shared pool. Every row padding while capturing: nothing is written."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if not self.backend.supports_cuda_graphs:
            raise RuntimeError(f"the {self.backend.name} attention backend cannot be captured "
                               "in a CUDA graph")
        none = np.zeros(0, dtype=np.int64)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # one capture stream for the shared pool
        current = torch.cuda.current_stream(self.device)
        for bucket in reversed(self.sizes):
            self._stage(bucket, none, none, none, none, np.zeros((0, 1), dtype=np.int64))
            dummy_lens = [1] * bucket
            # a warm-up run on the capture stream, outside the capture: compiles and loads
            # the Triton kernels and sets up cuBLAS, neither of which a capture allows
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._forward(bucket, dummy_lens)
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._forward(bucket, dummy_lens)
            self._graphs[bucket], self._outputs[bucket] = graph, out
        torch.cuda.synchronize(self.device)
