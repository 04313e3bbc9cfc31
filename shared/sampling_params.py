"""Sampling parameters of one request, declared once for every process.

The frontend validates them (clear errors before anything reaches the scheduler),
the scheduler re-validates them, and the worker's sampler reads them. Definitions
follow OpenAI / vLLM so that users of those engines get what they expect:

- ``temperature == 0`` means greedy (argmax of the penalised logits).
- ``top_k <= 0`` (vLLM's ``-1``) disables top-k; ``top_p == 1`` and ``min_p == 0`` disable those.
- ``repetition_penalty`` (HF / CTRL definition) divides positive and multiplies
  negative logits of every token seen in the prompt or the output; 1 disables it.
- ``presence_penalty`` subtracts a constant from the logits of tokens present in the
  output so far; ``frequency_penalty`` subtracts it times the token's output count.
- ``logprobs = k`` returns the sampled token's logprob and the top-k alternatives
  (from the raw model distribution, before penalties and temperature).
- ``prompt_logprobs = k`` returns the same for every prompt token (the first has none),
  computed in the prefill's forward pass; such a request takes no prefix-cache hit.
- ``logit_bias`` (OpenAI's) adds its values to those tokens' logits before sampling
  (before penalties and temperature); reported logprobs do not see it.
- ``truncate_prompt_tokens = k`` keeps the prompt's last k tokens (the frontend cuts it
  after tokenizing; -1: the most that leaves room for one output token).

``SamplingParams`` is a ``msgspec.Struct`` nested in ``AddRequest``, ``NewRequest`` and
``GenerateRequest`` (``shared/protocol.py``): an array of its fields in declaration order
on the wire, so new fields go last with a default. ``__post_init__`` validates, both
when code builds one and when a frame is decoded into one. Copy with a change through
``msgspec.structs.replace(params, ...)`` (which validates again).
"""

from __future__ import annotations

import json as _json
import math
from typing import Any

import msgspec

MAX_N = 128
MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs limit
MAX_STOP_SEQUENCES = 16
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 300  # entries (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0  # OpenAI: each bias in [-100, 100]
# structured outputs: a JSON schema, regex or grammar (characters), all choices together
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 1024


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"must be finite, got {value}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {value!r}")
    return value


class StructuredOutputsParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True
):
    """A constraint on the output (vLLM's ``StructuredOutputsParams``); exactly one is set.
    What each means: ``shared/structured_output.py``."""

    json: str | None = None  # a JSON schema as JSON text (a dict is serialized on construction)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF (GBNF) grammar
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # as vLLM's: json=schema_dict is accepted
            self.json = _json.dumps(self.json)
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                f"exactly one of json, regex, choice, grammar, json_object, got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs", "choice must be non-empty strings")
        texts = self.choice if self.choice is not None else [
            t for t in (self.json, self.regex, self.grammar) if t is not None]
        if not all(isinstance(t, str) for t in texts):
            raise SamplingParamsError("structured_outputs", "json, regex and grammar must be text")
        if sum(map(len, texts)) > MAX_CONSTRAINT_CHARS or len(texts) > MAX_CHOICES:
            raise SamplingParamsError(
                "structured_outputs", f"at most {MAX_CONSTRAINT_CHARS} characters of schema, regex, "
                f"grammar or choices, and at most {MAX_CHOICES} choices")


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True
):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = []  # a single str is accepted by the constructor
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # appended for issue 16 (append-only on the wire)
    prompt_logprobs: int | None = None  # logprobs of every prompt token, with top-k alternatives
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured_outputs: StructuredOutputsParams | None = None
    # appended for issue 24: keep only the prompt's last k tokens (vLLM's; -1: as many as
    # max_model_len leaves room for, one output token at least); applied by the frontend
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError for the first value out of range."""
        n = _integer("n", self.n)
        if not 1 <= n <= MAX_N:
            raise SamplingParamsError("n", f"must be in [1, {MAX_N}], got {n}")
        t = _finite("temperature", self.temperature)
        if t < 0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {t}")
        p = _finite("top_p", self.top_p)
        if not 0 < p <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {p}")
        _integer("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        mp = _finite("min_p", self.min_p)
        if not 0 <= mp <= 1:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {mp}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {v}")
        rp = _finite("repetition_penalty", self.repetition_penalty)
        if not 0 < rp <= 10:
            raise SamplingParamsError("repetition_penalty", f"must be in (0, 10], got {rp}")
        if self.seed is not None:
            _integer("seed", self.seed)
            if not -(2**63) <= self.seed < 2**63:
                raise SamplingParamsError("seed", "must fit in a signed 64-bit integer")
        self._validate_stops()
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        _integer("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise SamplingParamsError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        self._validate_logit_bias()
        if self.truncate_prompt_tokens is not None:
            k = _integer("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if k < -1 or k == 0:
                raise SamplingParamsError("truncate_prompt_tokens",
                                          f"must be -1 or >= 1, got {k}")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if len(bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        for tid, value in bias.items():
            _integer("logit_bias", tid)
            if tid < 0:
                raise SamplingParamsError("logit_bias", f"token ids must be >= 0, got {tid}")
            v = _finite("logit_bias", value)
            if not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
                raise SamplingParamsError(
                    "logit_bias", f"values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {v}")

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise SamplingParamsError("stop", f"at most {MAX_STOP_SEQUENCES} stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError("stop", f"a stop string is over {MAX_STOP_STRING_CHARS} chars")
        if len(self.stop_token_ids) > 1024:
            raise SamplingParamsError("stop_token_ids", "at most 1024 stop token ids")
        for tid in self.stop_token_ids:
            _integer("stop_token_ids", tid)
            if tid < 0:
                raise SamplingParamsError("stop_token_ids", f"must be >= 0, got {tid}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise SamplingParamsError("include_stop_str_in_output", "must be a boolean")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", "must be a boolean")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def to_dict(self) -> dict[str, Any]:
        data = msgspec.structs.asdict(self)
        data["stop"], data["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        unknown = set(data) - set(cls.__struct_fields__)
        if unknown:
            raise SamplingParamsError(min(unknown), "unknown sampling parameter")
        so = data.get("structured_outputs")
        if isinstance(so, dict):  # {"json": {...}} as vLLM's extra body
            unknown = set(so) - set(StructuredOutputsParams.__struct_fields__)
            if unknown:
                raise SamplingParamsError("structured_outputs", f"unknown field {min(unknown)!r}")
            data = {**data, "structured_outputs": StructuredOutputsParams(**so)}
        return cls(**data)
