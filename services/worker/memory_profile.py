"""The KV pool's size on CUDA, from a profiling step (vLLM's rule).

After the weights load, ``dummy_step`` runs the largest step the scheduler may send:
``max_num_batched_tokens`` tokens of prefill over up to ``max_num_seqs`` sequences,
each sequence's logits, and the sampler's heaviest path (penalties, top-k, top-p,
logprobs), through a one-block KV cache that nothing is written to (slot -1; every
block-table entry is that block). Its peak allocated memory above the weights is what
a step needs besides the pool, and the pool takes

    total x gpu_memory_utilization - (weights + peak activations + non-torch + graph reserve)

where non-torch is what the process took outside torch's allocator while loading and
profiling (library workspaces, loaded kernels), and the graph reserve is left for the
decode CUDA graphs captured after the pool. It is capped by the memory free after
profiling, less the reserve and the peak activations (given back to the device when
that was read, needed again by every large step), so another process on the GPU shrinks
the pool instead of failing its allocation. ``kv_cache_budget`` is the arithmetic (tested on the CPU),
``dummy_step`` the step (it runs anywhere), ``profile_memory`` the CUDA measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.model_runner import allocate_kv_caches
from services.worker.models.llama import LlamaForCausalLM
from services.worker.sampler import Sampler, SamplingRow
from shared.sampling_params import SamplingParams

# left free for the decode graphs besides their logits buffer (graph_reserve_bytes): their
# pool holds one decode step's intermediates at the largest bucket, and the instantiated
# graphs take device memory outside torch's allocator; capture logs what they really took
GRAPH_RESERVE_BYTES = 512 * 2**20


def graph_reserve_bytes(max_batch_size: int, vocab_size: int) -> int:
    """Device memory kept out of the KV pool for the decode graphs: GRAPH_RESERVE_BYTES
    and their persistent [max_batch_size, vocab] fp32 logits (cuda_graphs.DecodeGraphs)."""
    return GRAPH_RESERVE_BYTES + max_batch_size * vocab_size * 4


@dataclass(frozen=True)
class MemoryProfile:
    """One device's memory around the profiling step, in bytes."""

    total: int
    free: int  # after the step, its activations given back to the device
    weights: int  # allocated by torch before the step: weights, rotary tables
    peak_activations: int  # the step's peak allocation above that
    non_torch: int  # taken outside torch's allocator since the baseline


def kv_cache_budget(profile: MemoryProfile, utilization: float, graph_reserve: int) -> int:
    """Bytes the KV pool may take (0: none left); see the module docstring."""
    wanted = (int(profile.total * utilization) - profile.weights - profile.peak_activations
              - profile.non_torch - graph_reserve)
    # free was read after the profiling step handed its activations back: later steps
    # need them again, so the cap leaves them out as it leaves the graphs' reserve
    return max(0, min(wanted, profile.free - graph_reserve - profile.peak_activations))


def describe(profile: MemoryProfile, utilization: float, graph_reserve: int) -> str:
    """The budget's terms, for the log and the error when nothing is left."""
    gib = 2**30
    return (f"{profile.total / gib:.2f} GiB x {utilization} - weights "
            f"{profile.weights / gib:.2f} - activations {profile.peak_activations / gib:.2f} - "
            f"non-torch {profile.non_torch / gib:.2f} - graph reserve {graph_reserve / gib:.2f} "
            f"GiB (free after profiling: {profile.free / gib:.2f} GiB)")


@torch.inference_mode()
def dummy_step(
    model: LlamaForCausalLM, backend: AttentionBackend, max_num_batched_tokens: int,
    max_num_seqs: int, max_model_len: int, block_size: int, kv_dtype: torch.dtype,
    device: torch.device,
) -> None:
    """The largest step, on dummy tokens (see the module docstring); every rank of a
    tensor-parallel group runs it (the forward's collectives), rank 0 also samples."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    total = min(max_num_batched_tokens, num_seqs * max_model_len)
    per, extra = divmod(total, num_seqs)  # per >= 1: num_seqs <= total
    # ascending: sequences of one token (decodes) first, as the backends expect
    lens = np.array([per] * (num_seqs - extra) + [per + 1] * extra, dtype=np.int64)
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    positions = np.arange(total) - np.repeat(qsl[:-1], lens)
    kv_caches = allocate_kv_caches(model, 1, block_size, kv_dtype, device)

    def up(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        num_tokens=total,
        num_decodes=int((lens == 1).sum()),
        query_start_loc=up(qsl, torch.int32),
        seq_lens=up(lens, torch.int32),
        block_tables=torch.zeros(num_seqs, -(-int(lens.max()) // block_size), dtype=torch.int32,
                                 device=device),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=device),
        max_query_len=int(lens.max()),
        max_seq_len=int(lens.max()),
        query_start_loc_host=qsl.tolist(),
        seq_lens_host=lens.tolist(),
    )
    input_ids = torch.zeros(total, dtype=torch.int64, device=device)
    hidden = model(input_ids, up(positions, torch.int64), kv_caches, meta, backend)
    logits = model.compute_logits(hidden.index_select(0, up(qsl[1:] - 1, torch.int64)))
    if model.tp.is_first:
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                logprobs=5, max_tokens=None)
        rows = [SamplingRow(params, [0], [0]) for _ in range(num_seqs)]
        sampler = Sampler(model.config.vocab_size, model.config.eos_token_ids, device, seed=0)
        sampler(logits, rows)


def cuda_used(device: torch.device) -> int:
    """Bytes in use on the device by anyone (this process's context included)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def profile_memory(step: Callable[[], None], device: torch.device,
                   baseline_used: int) -> MemoryProfile:
    """Runs ``step`` once and measures it. ``baseline_used``: ``cuda_used`` before the
    weights were loaded (other processes and this CUDA context: not the worker's)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - baseline_used - torch.cuda.memory_reserved(device))
    return MemoryProfile(total=total, free=free, weights=weights, peak_activations=peak,
                         non_torch=non_torch)
