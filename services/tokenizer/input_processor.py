"""The frontend's input side: model limits, the tokenizer, and prompt validation.

Every API turns what its client sent into ``PromptInput``s (the frontend's own type:
the native API from a ``GenerateRequest``, the HTTP API from its JSON bodies, the
offline ``LLM`` from its arguments), and each becomes the prompt token ids and resolved
``SamplingParams`` of an ``AddRequest`` here, or an ``InvalidRequest`` naming what is
wrong, so a bad request never reaches the scheduler (RELIABILITY.md: validate after
defaults are resolved). Tokenization is ``tokenizer(prompt)["input_ids"]``, chat is
``apply_chat_template(..., tokenize=False)`` then that: one way for every API, so the
service and the offline engine give a prompt the same tokens. ``load_tokenizer`` is the
one tokenizer loader of the project.

Sampling parameters were already range-checked by the codec's typed decode (the
``SamplingParams`` constructor validates); what needs the model (vocab, lengths) is
checked here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shared import model_limits
from shared.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A request the client got wrong; ``code`` goes into the ``RequestError``."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int  # prompt + output tokens
    vocab_size: int  # token ids must be below this


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a client request; exactly one of prompt, prompt_token_ids, messages."""

    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatTurn] | None = None  # rendered through the model's chat template
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens resolved (never None)


def load_limits(model_dir: Path, max_model_len: int | None = None) -> ModelLimits:
    """The model's vocab size and context length from config.json.

    A configured ``max_model_len`` wins but may not exceed what the model allows
    (``shared.model_limits``: the worker applies the same rule, so both sides agree).
    """
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or {}  # multimodal configs nest the language model
    vocab_size = config.get("vocab_size") or text.get("vocab_size")
    if not isinstance(vocab_size, int):
        # a ValueError, not a TypeError: a bad model directory is a start-up error the
        # frontend reports as such
        raise ValueError(f"{model_dir}/config.json lacks vocab_size")  # noqa: TRY004
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    try:
        limit = model_limits.max_model_len(config, max_model_len)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {e}") from None
    return ModelLimits(max_model_len=limit, vocab_size=vocab_size)


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's HF tokenizer, or None when the directory has no tokenizer files.

    Directories that ``pagoda fetch`` writes name ``PreTrainedTokenizerFast``; loading
    that class directly gives the same tokenizer as ``AutoTokenizer`` without importing
    torch (seconds of start-up). Anything else goes through ``AutoTokenizer``.
    """
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    if tc.get("tokenizer_class") == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class InputProcessor:
    """PromptInput -> ProcessedPrompt, or InvalidRequest. No I/O, no state."""

    def __init__(self, tokenizer: Any | None, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def process(self, req: PromptInput) -> ProcessedPrompt:
        token_ids = self._prompt_token_ids(req)
        params = self._resolve_params(req.sampling_params, len(token_ids))
        return ProcessedPrompt(token_ids, params)

    def process_all(self, reqs: list[PromptInput]) -> list[ProcessedPrompt]:
        """Every prompt of one client request, all valid before any reaches the engine."""
        return [self.process(r) for r in reqs]

    def _prompt_token_ids(self, req: PromptInput) -> list[int]:
        given = [name for name in ("prompt", "prompt_token_ids", "messages")
                 if getattr(req, name) is not None]
        if len(given) != 1:
            raise InvalidRequest(
                "exactly one of prompt, prompt_token_ids, messages must be given, "
                f"got {', '.join(given) or 'none'}"
            )
        if req.prompt_token_ids is not None:
            token_ids = req.prompt_token_ids
            if not token_ids:
                raise InvalidRequest("prompt_token_ids must not be empty")
            self._check_vocab(token_ids, "prompt_token_ids")
        elif req.prompt is not None:
            if not req.prompt:
                raise InvalidRequest("prompt must not be empty")
            token_ids = self._tokenize(req.prompt)
        else:
            token_ids = self._tokenize(self._render_chat(req))
        if not token_ids:
            raise InvalidRequest("the prompt tokenizes to no tokens")
        max_len = self.limits.max_model_len
        if len(token_ids) >= max_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; it must be shorter than "
                f"max_model_len {max_len} to leave room for output"
            )
        return token_ids

    # -- the HTTP API's /tokenize and /detokenize use these directly -------------------------
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` as a prompt is tokenized (special tokens included)."""
        return self._tokenize(text)

    def render_chat(self, req: PromptInput) -> str:
        """``req.messages`` through the chat template, or ``InvalidRequest``."""
        return self._render_chat(req)

    def detokenize(self, token_ids: list[int]) -> str:
        self._check_vocab(token_ids, "tokens")
        return str(self._require_tokenizer().decode(token_ids))

    def _render_chat(self, req: PromptInput) -> str:
        if not req.messages:
            raise InvalidRequest("messages must not be empty")
        tokenizer = self._require_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("the model has no chat template; send a prompt instead")
        conversation = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt
            )
        except Exception as e:  # noqa: BLE001 -- templates raise TemplateError, TypeError, ... for bad input
            raise InvalidRequest(f"the chat template refused the messages: {e}"[:500]) from None
        if not isinstance(text, str) or not text:
            raise InvalidRequest("the chat template rendered no text")
        return text

    def _tokenize(self, text: str) -> list[int]:
        ids = self._require_tokenizer()(text)["input_ids"]
        return list(ids)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequest("the model has no tokenizer; send prompt_token_ids")
        return self.tokenizer

    def _check_vocab(self, token_ids: list[int], name: str) -> None:
        vocab = self.limits.vocab_size
        for i, t in enumerate(token_ids):
            if not 0 <= t < vocab:  # the codec already refused negatives; keep the check whole
                raise InvalidRequest(f"{name}[{i}] = {t} is not in the vocabulary (0..{vocab - 1})")

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        self._check_vocab(params.stop_token_ids, "stop_token_ids")
        room = self.limits.max_model_len - prompt_len
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: "
                f"together {prompt_len + max_tokens}, over max_model_len "
                f"{self.limits.max_model_len}"
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens {params.min_tokens} exceeds max_tokens {max_tokens} "
                f"(max_model_len {self.limits.max_model_len} - {prompt_len} prompt tokens)"
            )
        if params.max_tokens is None:
            params = msgspec.structs.replace(params, max_tokens=max_tokens)
        return params
