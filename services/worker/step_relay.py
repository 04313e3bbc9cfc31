"""The in-process engine's tensor-parallel group: rank 0 relays each step to the others.

In the served stack every rank subscribes to the scheduler's step socket. The offline
engine (``pagoda/engine.py``) has no sockets: its scheduler and rank 0 live in the
caller's process, and ranks 1..M-1 are child processes (``start_followers``) that
receive each ``StepBatch`` from rank 0 over the group's own process group (its msgpack
bytes, broadcast) and run it, so every rank runs the same forward pass. A zero-length
broadcast ends them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch

from services.worker.model_config import ModelConfig
from services.worker.parallel import (
    SINGLE,
    CollectiveTimer,
    ShardingError,
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
    shard_sizes,
)
from services.worker.runner_builder import RunnerSpec, build_runner, resolve_device
from shared.codec import decode, encode
from shared.protocol import SCHEDULER_TO_WORKER, StepBatch

log = logging.getLogger(__name__)


class StepRelay:
    """Rank 0's ``send`` and the other ranks' ``receive`` of each step (collectives:
    every rank of the group calls its side once per step)."""

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp = tp
        self.device = device

    def send(self, batch: StepBatch | None) -> None:
        """The step (None: stop) to every other rank."""
        data = b"" if batch is None else encode(batch)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.tp.broadcast_first(size)
        if data:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self.tp.broadcast_first(payload)

    def receive(self) -> StepBatch | None:
        size = self.tp.broadcast_first(torch.zeros(1, dtype=torch.int64, device=self.device))
        n = int(size.item())
        if n == 0:
            return None
        payload = self.tp.broadcast_first(torch.empty(n, dtype=torch.uint8, device=self.device))
        batch = decode(payload.cpu().numpy().tobytes(), SCHEDULER_TO_WORKER)
        assert isinstance(batch, StepBatch)  # rank 0 encoded one, on a private channel
        return batch


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower rank needs to build the same runner as rank 0."""

    model_dir: str
    runner_spec: RunnerSpec
    size: int
    init_method: str
    timeout_s: float
    threads: int | None


def _follow(rank: int, spec: FollowerSpec) -> None:
    """A follower rank's body: the same runner as rank 0, each step rank 0 relays."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device = resolve_device(spec.runner_spec.device)
    tp = init_tensor_parallel(rank, spec.size, spec.init_method, device, spec.timeout_s)
    try:
        runner = build_runner(Path(spec.model_dir), spec.runner_spec, tp).runner
        relay = StepRelay(tp, device)
        while (batch := relay.receive()) is not None:
            runner.execute(batch)
    finally:
        destroy_tensor_parallel(tp)


def start_followers(spec: FollowerSpec) -> list[BaseProcess]:
    """Ranks 1..size-1 as child processes (spawned: a fork of a process that already
    holds torch threads or a CUDA context is unsafe)."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, spec.size):
        proc = ctx.Process(target=_follow, args=(rank, spec), name=f"pagoda-tp-rank-{rank}",
                           daemon=True)
        proc.start()
        procs.append(proc)
    log.info("tensor parallel: started ranks 1..%d (pids %s)", spec.size - 1,
             [p.pid for p in procs])
    return procs


def check_split(model_dir: str | os.PathLike[str], size: int) -> None:
    """ValueError naming the sizes of the model that ``size`` ranks cannot split."""
    cfg = ModelConfig.from_dir(model_dir)
    try:
        shard_sizes(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                    cfg.vocab_size, TensorParallel(0, size))
    except ShardingError as e:
        raise ValueError(f"{model_dir}: {e}") from None


def file_init_method(directory: str | os.PathLike[str]) -> str:
    """A ``file://`` rendezvous in ``directory`` (one host, no port to pick)."""
    return f"file://{Path(directory) / 'tp-rendezvous'}"


class TensorParallelGroup:
    """The offline engine's group: rank 0 here, the followers as children, and the
    relay between them. ``size`` 1: no group, every call a no-op."""

    def __init__(self, tp: TensorParallel, relay: StepRelay | None,
                 followers: list[BaseProcess], rendezvous: tempfile.TemporaryDirectory[str] | None,
                 ) -> None:
        self.tp, self._relay, self._followers, self._rendezvous = tp, relay, followers, rendezvous

    @classmethod
    def start(cls, model_dir: Path, runner_spec: RunnerSpec, size: int,
              timeout_s: float = 600.0) -> TensorParallelGroup:
        if size == 1:
            return cls(SINGLE, None, [], None)
        rendezvous = tempfile.TemporaryDirectory(prefix="pagoda-tp-")
        init_method = file_init_method(rendezvous.name)
        # the machine's threads shared out between the ranks
        threads = max(1, torch.get_num_threads() // size)
        spec = FollowerSpec(str(model_dir), runner_spec, size, init_method, timeout_s, threads)
        followers = start_followers(spec)
        device = resolve_device(runner_spec.device)
        try:
            torch.set_num_threads(threads)
            # rank 0 times its collectives: the share of a step they take (the TP benchmark)
            tp = replace(init_tensor_parallel(0, size, init_method, device, timeout_s),
                         timer=CollectiveTimer())
        except BaseException:
            for p in followers:
                p.terminate()
            rendezvous.cleanup()
            raise
        return cls(tp, StepRelay(tp, device), followers, rendezvous)

    def relay_step(self, batch: StepBatch) -> None:
        if self._relay is not None:
            self._check_followers()
            self._relay.send(batch)

    def _check_followers(self) -> None:
        dead = [p for p in self._followers if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank(s) exited: "
                               f"{[(p.name, p.exitcode) for p in dead]}")

    def stop(self) -> None:
        if self._relay is None:
            return
        relay, self._relay = self._relay, None
        if all(p.is_alive() for p in self._followers):
            relay.send(None)
        for p in self._followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        destroy_tensor_parallel(self.tp)
        if self._rendezvous is not None:
            self._rendezvous.cleanup()
