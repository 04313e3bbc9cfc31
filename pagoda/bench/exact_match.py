"""``pagoda bench --exact-match N``: how often pagoda's greedy tokens are HF's.

A setting that changes tokens (``--kv-cache-dtype bfloat16`` under a float32 model) is
opt-in and reported with this rate. The oracle is HF transformers in the engine's dtype,
each request alone, greedy, without EOS handling (pagoda's bench requests ignore EOS),
run as a plain loop of forwards over HF's own cache. pagoda's side is the same requests
through the offline engine, batched as served. A request matches exactly when its whole
output equals HF's; the token agreement is the share of output tokens before the first
difference, over all the requests compared.
"""

from __future__ import annotations

from typing import Any

from pagoda.bench.workload import Workload


def pagoda_tokens(llm: Any, work: Workload, n: int) -> list[list[int]]:
    """The first ``n`` requests' greedy outputs through ``llm`` (pagoda.LLM), batched."""
    from pagoda.bench.runner_offline import greedy_exact

    outs = llm.generate(work.prompts[:n], [greedy_exact(k) for k in work.output_lens[:n]],
                        use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def hf_tokens(model_dir: str, work: Workload, n: int, dtype: str, device: str,
              progress: bool = False) -> list[list[int]]:
    """The first ``n`` requests' greedy outputs through HF transformers, one at a time."""
    import torch
    from tqdm import tqdm

    from pagoda.bench.baseline_hf import load_hf

    hf = load_hf(model_dir, dtype, device)
    outputs = []
    with torch.inference_mode():
        for prompt, length in tqdm(list(zip(work.prompts[:n], work.output_lens[:n])),
                                   desc="HF exact-match oracle", disable=not progress):
            cache = hf_cache(hf)  # filled in place by each forward
            step = torch.tensor([prompt], device=hf.device)
            tokens: list[int] = []
            while len(tokens) < length:
                logits = hf(step, use_cache=True, **cache).logits
                tokens.append(int(logits[0, -1].argmax()))
                step = torch.tensor([[tokens[-1]]], device=hf.device)
            outputs.append(tokens)
    del hf
    return outputs


def hf_cache(hf: Any, cache_class: Any = None) -> dict[str, Any]:
    """A fresh KV cache for ``hf``'s forward, as the keyword its transformers version takes
    (``cache`` from 5.x, ``past_key_values`` before); ``cache_class``: a DynamicCache
    subclass (default DynamicCache)."""
    import inspect

    from transformers import DynamicCache

    cls = cache_class or DynamicCache
    try:
        cache = cls(config=hf.config)
    except TypeError:  # older transformers: no config argument
        cache = cls()
    keyword = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return {keyword: cache}


def compare(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Exact-match figures of two lists of outputs of the same requests."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} outputs against {len(theirs)}")
    exact = sum(a == b for a, b in zip(ours, theirs, strict=True))
    agreed = total = 0
    first_difference: list[int | None] = []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed += same
        total += len(b)
        first_difference.append(None if a == b else same)
    return {
        "requests": len(ours),
        "exact": exact,
        "exact_rate": exact / len(ours) if ours else None,
        "token_agreement": agreed / total if total else None,
        "first_difference": first_difference,  # per request: the index, None when equal
    }
