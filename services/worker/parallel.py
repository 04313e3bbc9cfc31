"""Tensor parallelism: one worker group's ranks and the collectives the model needs.

A model too big or too slow for one device is split over the ``size`` ranks of a group
(Megatron style, as vLLM does it): column-parallel q/k/v and gate/up projections, row-
parallel o and down projections followed by an all-reduce, a vocab-parallel embedding
(each rank holds a slice of the rows, the lookups of the others are zero, all-reduced)
and a vocab-parallel lm_head whose logits are gathered. ``TensorParallel`` carries the
rank, the size and the torch.distributed process group (gloo on a CPU, NCCL on CUDA);
``SINGLE`` is the group of one every unsplit model uses, whose collectives are no-ops.

``shard_sizes`` is where a model's shape is checked against the group: sizes that do
not divide are refused with the numbers, the vocabulary is padded (as vLLM pads it).
Each rank reads only its slices at load time (``services/worker/loader.py``).
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class ShardingError(ValueError):
    """A model whose sizes do not split over the group."""


@dataclass
class CollectiveTimer:
    """Seconds spent in collectives (the all-reduce share the TP benchmark prints)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)  # a ProcessGroup
    timer: CollectiveTimer | None = field(default=None, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (the row-parallel layers' partial outputs)."""
        if self.size == 1:
            return x
        started = time.perf_counter() if self.timer is not None else 0.0
        dist.all_reduce(x, group=self.group)
        self._count(started)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, in rank order (logits)."""
        if self.size == 1:
            return x
        started = time.perf_counter() if self.timer is not None else 0.0
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        self._count(started)
        return torch.cat(parts, dim=-1)

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (same shape and dtype everywhere; sampled tokens)."""
        if self.size == 1:
            return x
        started = time.perf_counter() if self.timer is not None else 0.0
        dist.broadcast(x, src=0, group=self.group)  # the group spans the whole world
        self._count(started)
        return x

    def _count(self, started: float) -> None:
        if self.timer is not None:
            self.timer.seconds += time.perf_counter() - started
            self.timer.calls += 1


SINGLE = TensorParallel()


@dataclass(frozen=True)
class ShardSizes:
    """One rank's share of a model's split dimensions."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 each when ranks outnumber KV heads)
    kv_head_start: int  # the first KV head this rank holds
    intermediate: int  # MLP columns on this rank
    vocab_padded: int  # the vocabulary padded to a multiple of the group size
    vocab_per_rank: int
    vocab_start: int  # the first vocabulary row this rank holds


def shard_sizes(num_heads: int, num_kv_heads: int, intermediate: int, vocab: int,
                tp: TensorParallel) -> ShardSizes:
    """This rank's share, or ShardingError naming the sizes that do not split."""
    m = tp.size
    bad = []
    if num_heads % m:
        bad.append(f"{num_heads} attention heads")
    if num_kv_heads % m and m % num_kv_heads:
        bad.append(f"{num_kv_heads} KV heads (neither divisible by {m} nor dividing it)")
    if intermediate % m:
        bad.append(f"intermediate size {intermediate}")
    if bad:
        raise ShardingError(f"tensor_parallel_size {m} does not split {', '.join(bad)}; "
                            f"choose a size that divides them")
    if num_kv_heads >= m:
        kv_local, kv_start = num_kv_heads // m, tp.rank * (num_kv_heads // m)
    else:  # fewer KV heads than ranks: each is replicated on m / num_kv_heads ranks
        kv_local, kv_start = 1, tp.rank * num_kv_heads // m
    padded = -(-vocab // m) * m
    per_rank = padded // m
    return ShardSizes(num_heads // m, kv_local, kv_start, intermediate // m, padded, per_rank,
                      tp.rank * per_rank)


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float, step_timeout_s: float | None = None) -> TensorParallel:
    """Join the group's process group: gloo on a CPU, NCCL on CUDA. Ranks may start up to
    ``timeout_s`` apart; afterwards a rank that dies or hangs makes the others'
    collectives fail after ``step_timeout_s`` (default: the same), never wait forever."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("rank %d of %d: joining the %s group at %s", rank, size, backend, init_method)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    if step_timeout_s is not None and step_timeout_s != timeout_s:
        group = dist.new_group(list(range(size)), backend=backend,
                               timeout=datetime.timedelta(seconds=step_timeout_s))
    log.info("rank %d of %d: the group is complete", rank, size)
    return TensorParallel(rank, size, group)


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
