"""Benchmark (not a test): each Triton kernel per shape beside torch SDPA in the same run.

    python -m kernels.bench [--dtype bf16] [--heads 32] [--kv-heads 8] [--head-dim 128]
                            [--block-size 16] [--max-tokens 4194304]

On a GPU: paged decode at batch 1-256 x context 128-32k, varlen prefill (fresh prompts
and chunks over cached context), and the cache write. Each row gives the time, the
achieved GB/s (decode, cache write: bytes that must cross HBM) or TFLOP/s (prefill:
causal QK^T and PV, 4 * heads * head_dim per query-key pair), the fraction of the
device's peak (table below; blank for an unknown device), the ratio to the baseline
(torch SDPA over K/V gathered from the paged cache beforehand, gather untimed, so
the baseline is dense FlashAttention-class attention; index_copy_ for the write)
and the largest difference between the two outputs. Shapes above ``--max-tokens``
cached tokens are skipped (the gathered copy doubles the memory).

Without a GPU it sets TRITON_INTERPRET=1 and runs a few tiny shapes once: a smoke
check of the wiring (seconds); its times say nothing about the kernels.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference

# name fragment -> (HBM bytes/s, dense fp16/bf16 tensor FLOP/s), vendor datasheets
_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (4.8e12, 989e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),
    "A100": (2.0e12, 312e12),
    "L40S": (0.864e12, 362e12),
    "A10G": (0.6e12, 70e12),
    "RTX 4090": (1.0e12, 165e12),
}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Config:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def elem(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    seconds: float
    rate: float  # GB/s or TFLOP/s
    unit: str
    peak_fraction: float | None
    baseline_seconds: float
    max_diff: float

    def format(self) -> str:
        frac = f"{self.peak_fraction:6.1%}" if self.peak_fraction is not None else "     -"
        ratio = self.baseline_seconds / self.seconds
        return (f"{self.kernel:<12} {self.shape:<28} {self.seconds * 1e6:10.1f} "
                f"{self.rate:9.3g} {self.unit:<7} {frac} {ratio:8.2f}x {self.max_diff:9.2e}")


Timer = Callable[[Callable[[], object]], float]  # fn -> seconds per call


def _gpu_timer(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=50)) * 1e-3


def _cpu_timer(fn: Callable[[], object]) -> float:
    fn()  # the first call decorates/traces; the smoke check times one more
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _paged_setup(
    cfg: Config, seq_lens: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # k_cache, v_cache, block_tables
    """A cache holding exactly these sequences in shuffled (non-contiguous) blocks."""
    bs = cfg.block_size
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(cfg.device)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32, device=cfg.device)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(shape, dtype=cfg.dtype, device=cfg.device)
    v = torch.randn(shape, dtype=cfg.dtype, device=cfg.device)
    return k, v, tables


def _gathered(cache: torch.Tensor, tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[batch, kv_heads, seq_len, D] dense copy of equal-length sequences."""
    nb = -(-seq_len // cache.shape[1])
    return cache[tables[:, :nb].long()].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def bench_decode(cfg: Config, batch: int, context: int, timer: Timer, peak_bw: float | None) -> Row:
    from kernels.paged_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    k, v, tables = _paged_setup(cfg, [context] * batch, gen)
    lens = torch.full((batch,), context, dtype=torch.int32, device=cfg.device)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=cfg.device)
    scale = cfg.head_dim**-0.5
    out = torch.empty_like(q)
    seconds = timer(lambda: paged_decode_attention(q, k, v, tables, lens, context, scale, out=out))
    # baseline: the query heads of a KV head as its query rows, over dense K/V
    kd, vd = _gathered(k, tables, context), _gathered(v, tables, context)
    group = cfg.num_heads // cfg.num_kv_heads
    qd = q.view(batch, cfg.num_kv_heads, group, cfg.head_dim)
    base = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale))
    ref = F.scaled_dot_product_attention(qd, kd, vd, scale=scale).reshape_as(q)
    bytes_moved = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * cfg.elem
    rate = bytes_moved / seconds
    return Row("decode", f"batch={batch} ctx={context}", seconds, rate / 1e9, "GB/s",
               rate / peak_bw if peak_bw else None, base, _max_diff(out, ref))


def bench_prefill(
    cfg: Config, batch: int, query_len: int, context: int, timer: Timer, peak_flops: float | None
) -> Row:
    from kernels.prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(1)
    seq_len = context + query_len
    k, v, tables = _paged_setup(cfg, [seq_len] * batch, gen)
    dev = cfg.device
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * query_len
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch * query_len, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=dev)
    scale = cfg.head_dim**-0.5
    out = torch.empty_like(q)
    seconds = timer(
        lambda: paged_prefill_attention(q, k, v, qsl, lens, tables, query_len, scale, out=out)
    )
    group = cfg.num_heads // cfg.num_kv_heads
    kd = _gathered(k, tables, seq_len).repeat_interleave(group, dim=1)  # [B, H, S, D]
    vd = _gathered(v, tables, seq_len).repeat_interleave(group, dim=1)
    qd = q.view(batch, query_len, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    if context == 0:
        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
    else:  # causal with an offset: an explicit mask (flash's is_causal aligns top-left)
        rows = torch.arange(query_len, device=dev)[:, None] + context
        mask = torch.arange(seq_len, device=dev)[None, :] <= rows

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    base = timer(sdpa)
    ref = sdpa().transpose(1, 2).reshape_as(q)
    pairs = batch * (query_len * context + query_len * (query_len + 1) // 2)
    rate = 4 * cfg.num_heads * cfg.head_dim * pairs / seconds
    return Row("prefill", f"batch={batch} q={query_len} ctx={context}", seconds, rate / 1e12,
               "TFLOP/s", rate / peak_flops if peak_flops else None, base, _max_diff(out, ref))


def bench_cache_write(cfg: Config, num_tokens: int, timer: Timer, peak_bw: float | None) -> Row:
    from kernels.cache_write import write_kv_cache

    dev, bs = cfg.device, cfg.block_size
    num_blocks = -(-num_tokens // bs) + 1
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    k_cache = torch.zeros(shape, dtype=cfg.dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(num_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.dtype, device=dev)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * bs, device="cpu")[:num_tokens].to(dev)
    seconds = timer(lambda: write_kv_cache(key, value, k_cache, v_cache, slots))
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    base = timer(lambda: reference.write_kv_cache(key, value, k_ref, v_ref, slots))
    rate = 2 * 2 * key.numel() * cfg.elem / seconds  # K and V, each read once and written once
    return Row("cache_write", f"tokens={num_tokens}", seconds, rate / 1e9, "GB/s",
               rate / peak_bw if peak_bw else None, base, _max_diff(k_cache, k_ref))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _shapes(
    on_gpu: bool, max_tokens: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], list[int]]:
    """(decode (batch, ctx), prefill (batch, query_len, ctx), cache write tokens)."""
    if not on_gpu:  # interpreter smoke check: one split-K decode, one chunk over context
        return [(2, 40), (1, 1100)], [(2, 24, 0), (1, 8, 20)], [16]
    decode = [(b, c) for b in (1, 8, 64, 256) for c in (128, 1024, 4096, 32768)
              if b * c <= max_tokens]
    prefill = [(1, 4096, 0), (1, 16384, 0), (8, 2048, 0), (64, 512, 0), (256, 128, 0),
               (4, 512, 3584), (1, 2048, 30720)]
    prefill = [p for p in prefill if p[0] * (p[1] + p[2]) <= max_tokens]
    return decode, prefill, [256, 4096, 32768]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="default: bf16 on a GPU, fp32 in the interpreter")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4 * 1024 * 1024,
                        help="skip shapes with more cached tokens than this")
    args = parser.parse_args(argv)

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        # must precede the first import of a kernel module (decoration reads it)
        os.environ["TRITON_INTERPRET"] = "1"
    from kernels.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise SystemExit("kernels.bench needs the triton package")
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = _DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    heads, kv_heads = (args.heads, args.kv_heads) if on_gpu else (4, 2)
    head_dim = args.head_dim if on_gpu else 64
    cfg = Config(heads, kv_heads, head_dim, args.block_size, dtype, device)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (Triton interpreter: smoke check)"
    peak_bw, peak_flops = next((p for k, p in _PEAKS.items() if k in name), (None, None))
    timer: Timer = _gpu_timer if on_gpu else _cpu_timer
    print(f"# {name}; heads {heads}/{kv_heads}, head_dim {head_dim}, block {args.block_size}, "
          f"{dtype}; peak {peak_bw and peak_bw / 1e12} TB/s, {peak_flops and peak_flops / 1e12} "
          "TFLOP/s; ratio = baseline time / ours (>1: ours faster)")
    print(f"{'kernel':<12} {'shape':<28} {'time us':>10} {'rate':>9} {'unit':<7} {'peak':>6} "
          f"{'vs base':>9} {'max diff':>9}")
    decode, prefill, writes = _shapes(on_gpu, args.max_tokens)
    for batch, ctx in decode:
        print(bench_decode(cfg, batch, ctx, timer, peak_bw).format(), flush=True)
    for batch, qlen, ctx in prefill:
        print(bench_prefill(cfg, batch, qlen, ctx, timer, peak_flops).format(), flush=True)
    for tokens in writes:
        print(bench_cache_write(cfg, tokens, timer, peak_bw).format(), flush=True)
        if on_gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
