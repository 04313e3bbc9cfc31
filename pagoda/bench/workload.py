"""The requests a benchmark sends: prompts as token ids and exact output lengths.

Every runner (offline, HTTP, ZMQ, HF baseline) takes the same ``Workload``, so the
figures compare like with like. Two sources:

- ``make_workload``: synthetic from a seed. Prompt and output lengths come from a
  ``LengthDist`` (``uniform:a,b`` or ``fixed:n``); prompts are cut from real English
  text (``corpus.txt``: the docstrings of nine of this project's modules, frozen in
  2026-12 so that editing a docstring no longer changes the benchmark), or, for a
  model without a tokenizer, are random token ids. The same seed gives the same
  workload, token for token, on every commit since.
- ``load_jsonl``: a file of prompts, one JSON object a line: ``{"prompt": "..."}``
  (optionally ``"prompt_token_ids"`` and ``"output_len"``), or a ShareGPT-style
  ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` whose
  first human turn is the prompt and first reply's length the output length. A file
  holding one JSON array of such objects (ShareGPT's own format) is accepted too.

Output lengths are exact: runners send ``ignore_eos`` with ``max_tokens`` = the length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).with_name("corpus.txt")


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids, one list per request
    output_lens: list[int]  # exact number of tokens each request generates

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.output_lens)} output lengths")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, num: int) -> Workload:
        return Workload(self.prompts[:num], self.output_lens[:num])

    def salted(self, salt: int, vocab_size: int) -> Workload:
        """The same lengths with each prompt's first token moved ``salt`` ids along: an
        engine that served this workload finds no cached prefix of the salted one (every
        block hash chains from the first block), while a step costs the same (its work
        does not depend on the token values)."""
        if not 0 <= salt < vocab_size:
            raise ValueError(f"salt must be in [0, {vocab_size}), got {salt}")
        prompts = [[(p[0] + salt) % vocab_size, *p[1:]] if p else [] for p in self.prompts]
        return Workload(prompts, list(self.output_lens))


@dataclass(frozen=True)
class LengthDist:
    """Integer lengths in [low, high], uniformly; ``low == high`` is a fixed length."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths must satisfy 1 <= low <= high, got [{self.low}, {self.high}]")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """``uniform:a,b``, ``fixed:n``, or the short forms ``a,b`` and ``n``."""
        kind, _, spec = text.rpartition(":")
        values = [int(v) for v in spec.split(",")]
        if kind in ("", "uniform") and len(values) == 2:
            return cls(values[0], values[1])
        if kind in ("", "fixed") and len(values) == 1:
            return cls(values[0], values[0])
        raise ValueError(f"a length distribution is uniform:a,b or fixed:n, got {text!r}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"fixed:{self.low}" if self.low == self.high else f"uniform:{self.low},{self.high}"


def corpus_text() -> str:
    """Real prose for prompts (see the module docstring)."""
    return CORPUS.read_text(encoding="utf-8")


def make_workload(tokenizer: Any, num: int, prompt_range: tuple[int, int] | LengthDist,
                  output_range: tuple[int, int] | LengthDist, seed: int = 0,
                  vocab_size: int | None = None) -> Workload:
    """``num`` seeded requests. With a tokenizer, each prompt is a window of the corpus's
    tokens at a random offset; without one (``tokenizer=None``), random ids in
    [3, vocab_size) (ids below 3 are usually BOS/EOS/PAD)."""
    prompt_dist = _dist(prompt_range)
    output_dist = _dist(output_range)
    rng = random.Random(seed)
    if tokenizer is None:
        if vocab_size is None or vocab_size <= 3:
            raise ValueError("random token-id prompts need the model's vocab_size")
        text_ids: list[int] = []
    else:
        text_ids = list(tokenizer(corpus_text())["input_ids"])
        # repeat the text until the longest prompt fits with room to choose an offset
        while len(text_ids) < 2 * prompt_dist.high:
            text_ids = text_ids + text_ids
    prompts, outs = [], []
    for _ in range(num):
        length = prompt_dist.sample(rng)
        if tokenizer is None:
            prompts.append([rng.randrange(3, vocab_size) for _ in range(length)])  # type: ignore[arg-type]
        else:
            start = rng.randrange(0, len(text_ids) - length)
            prompts.append(text_ids[start : start + length])
        outs.append(output_dist.sample(rng))
    return Workload(prompts, outs)


def _dist(value: tuple[int, int] | LengthDist) -> LengthDist:
    return value if isinstance(value, LengthDist) else LengthDist(*value)


@dataclass
class PromptRecord:
    """One parsed line of a prompt file, before tokenization."""

    prompt: str | None
    prompt_token_ids: list[int] | None
    # int; a reply (str) whose token count is the length; None: drawn from the distribution
    output_len: int | str | None


def parse_records(text: str) -> list[PromptRecord]:
    """The records of a JSONL file (or one JSON array of objects); blank lines skipped."""
    stripped = text.lstrip()
    items: Iterable[Any]
    if stripped.startswith("["):
        items = json.loads(stripped)
    else:
        items = (json.loads(line) for line in text.splitlines() if line.strip())
    return [_record(i, item) for i, item in enumerate(items)]


def _record(i: int, item: Any) -> PromptRecord:
    if not isinstance(item, dict):
        # a malformed file, not a programming error: ValueError like every record error
        raise ValueError(  # noqa: TRY004
            f"record {i}: expected a JSON object, got {type(item).__name__}")
    out_len = item.get("output_len", item.get("max_tokens"))
    if "conversations" in item:
        turns = item["conversations"]
        human = [t.get("value", "") for t in turns if t.get("from") in ("human", "user")]
        replies = [t.get("value", "") for t in turns if t.get("from") in ("gpt", "assistant")]
        if not human or not human[0]:
            raise ValueError(f"record {i}: a conversation without a human turn")
        return PromptRecord(human[0], None, out_len if out_len is not None else
                            (replies[0] if replies else None))
    ids = item.get("prompt_token_ids")
    prompt = item.get("prompt")
    if ids is None and not isinstance(prompt, str):
        raise ValueError(f"record {i}: needs a string 'prompt' or 'prompt_token_ids'")
    if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
        raise ValueError(f"record {i}: prompt_token_ids must be a non-empty list of ints")
    return PromptRecord(prompt if isinstance(prompt, str) else None, ids, out_len)


def load_jsonl(path: str | Path, tokenizer: Any, num: int | None, output_dist: LengthDist,
               seed: int = 0, max_prompt_len: int | None = None) -> Workload:
    """Up to ``num`` requests from a prompt file, in a seeded shuffled order. A
    ShareGPT reply (a string) sets the output length to its token count; records
    without a length draw one from ``output_dist``."""
    records = parse_records(Path(path).read_text(encoding="utf-8"))
    rng = random.Random(seed)
    rng.shuffle(records)
    prompts, outs = [], []
    for rec in records:
        if num is not None and len(prompts) >= num:
            break
        ids = rec.prompt_token_ids if rec.prompt_token_ids is not None else _tokenize(tokenizer, rec.prompt)
        if not ids or (max_prompt_len is not None and len(ids) > max_prompt_len):
            continue
        out = rec.output_len
        if isinstance(out, str):
            out = len(_tokenize(tokenizer, out))
        prompts.append(ids)
        outs.append(out if isinstance(out, int) and out > 0 else output_dist.sample(rng))
    if not prompts:
        raise ValueError(f"{path}: no usable prompts")
    return Workload(prompts, outs)


def _tokenize(tokenizer: Any, text: str | None) -> list[int]:
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer; this model has none (use prompt_token_ids)")
    return list(tokenizer(text or "", add_special_tokens=False)["input_ids"])


def arrival_times(num: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start) of a Poisson process of ``request_rate``
    requests/s (exponential gaps, seeded); ``inf`` sends everything at once."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed ^ 0x5EED)  # its own stream: the lengths stay as without arrivals
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def warmup_workload(work: Workload, num: int = 2, output_len: int = 4) -> Workload:
    """A few short requests to run before the measured ones: the first prompts reversed,
    so they warm the engine without leaving the run's prefixes in the prefix cache."""
    return Workload([p[::-1] for p in work.prompts[:num]], [output_len] * min(num, len(work)))
