"""The frontend's input side: model limits, the tokenizer, and prompt validation.

Every API turns what its client sent into ``PromptInput``s (the frontend's own type:
the native API from a ``GenerateRequest``, the HTTP API from its JSON bodies, the
offline ``LLM`` from its arguments), and each becomes the prompt token ids and resolved
``SamplingParams`` of an ``AddRequest`` here, or an ``InvalidRequest`` naming what is
wrong, so a bad request never reaches the scheduler (RELIABILITY.md: validate after
defaults are resolved). Tokenization is ``tokenizer(prompt)["input_ids"]``, chat is
``apply_chat_template(..., tokenize=False)`` then that without the tokenizer's own special
tokens (the template writes BOS; vLLM's default, ``add_special_tokens`` overrides either): one way for every API, so the
service and the offline engine give a prompt the same tokens. ``load_tokenizer`` (re-exported
from ``shared/tokenizer_loader.py``, which the scheduler uses too) is the one tokenizer
loader of the project. A structured-output constraint is checked here by building its
grammar (``shared/structured_output.py``), so an invalid schema, regex or grammar is an
``InvalidRequest`` too.

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
from shared.structured_output import GrammarError, check_constraint
from shared.tokenizer_loader import load_tokenizer  # noqa: F401 -- re-exported (main.py, pagoda.LLM)

# a rendered chat prompt larger than this is refused before tokenizing: twice the largest
# HTTP body by default, so only a template that multiplies its input reaches it
MAX_RENDERED_CHARS = 16 * 2**20

# what the template call itself sets; chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


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
    content: str | None  # None: an assistant turn that only called tools
    # an assistant's calls, OpenAI's shape with "arguments" parsed from JSON (what chat
    # templates expect, as in transformers and vLLM)
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None  # role "tool": the call it answers
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template gets it (keys only where set)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def chat_turn(where: str, role: str, content: str | None,
              calls: list[tuple[str, str, str]] | None = None,
              tool_call_id: str | None = None, name: str | None = None) -> ChatTurn:
    """A checked chat message (``calls``: an assistant's (id, name, arguments JSON));
    the rules both APIs share."""
    if calls and role != "assistant":
        raise InvalidRequest(f"{where}: only assistant messages have tool_calls")
    if content is None and not (role == "assistant" and calls):
        raise InvalidRequest(f"{where}: content may be null only in an assistant message "
                             "with tool_calls")
    if role == "tool" and not tool_call_id:
        raise InvalidRequest(f"{where}: a tool message needs the tool_call_id it answers")
    parsed = []
    for j, (call_id, function, text) in enumerate(calls or ()):
        try:
            arguments = json.loads(text) if text.strip() else {}
        except ValueError:
            raise InvalidRequest(f"{where}.tool_calls[{j}].function.arguments is not valid "
                                 "JSON") from None
        parsed.append({"id": call_id, "type": "function",
                       "function": {"name": function, "arguments": arguments}})
    return ChatTurn(role, content, tuple(parsed), tool_call_id, name)


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a client request; exactly one of prompt, prompt_token_ids, messages."""

    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatTurn] | None = None  # rendered through the model's chat template
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, for the chat template
    skip_special_tokens: bool = True  # False: the output text keeps them (tool call markers)
    # the tokenizer's special tokens (BOS) added to the text; None: yes for a prompt, no
    # for chat, whose template writes them (vLLM's defaults)
    add_special_tokens: bool | None = None
    # chat: the last (assistant) message is left open for the model to go on with
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # max_tokens resolved (never None)
    skip_special_tokens: bool = True


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


class InputProcessor:
    """PromptInput -> ProcessedPrompt, or InvalidRequest. No I/O, no state."""

    def __init__(self, tokenizer: Any | None, limits: ModelLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def process(self, req: PromptInput) -> ProcessedPrompt:
        token_ids = self._prompt_token_ids(req)
        params = self._resolve_params(req.sampling_params, len(token_ids))
        return ProcessedPrompt(token_ids, params, req.skip_special_tokens)

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
            token_ids = self._tokenize(req.prompt, req.add_special_tokens is not False)
        else:
            token_ids = self._tokenize(self._render_chat(req), bool(req.add_special_tokens))
        if not token_ids:
            raise InvalidRequest("the prompt tokenizes to no tokens")
        max_len = self.limits.max_model_len
        truncate = req.sampling_params.truncate_prompt_tokens
        if truncate is not None:  # the last tokens: the end of a prompt is what it asks
            token_ids = token_ids[-(max_len - 1 if truncate == -1 else truncate):]
        if len(token_ids) >= max_len:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; it must be shorter than "
                f"max_model_len {max_len} to leave room for output"
            )
        return token_ids

    # -- the HTTP API's /tokenize and /detokenize use these directly -------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` as a prompt is tokenized (by default with the special
        tokens the tokenizer adds; chat text is tokenized without them)."""
        return self._tokenize(text, add_special_tokens)

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
        conversation = [m.as_dict() for m in req.messages]
        # options only when given: a template sees exactly what it saw before they existed
        extra: dict[str, Any] = dict(req.chat_template_kwargs or {})
        if clash := sorted(set(extra) & RESERVED_TEMPLATE_KWARGS):
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(clash)}")
        if req.tools:
            extra["tools"] = req.tools
        if req.continue_final_message:
            if req.add_generation_prompt:
                raise InvalidRequest("continue_final_message and add_generation_prompt cannot "
                                     "both be true")
            if req.messages[-1].role != "assistant":
                raise InvalidRequest("continue_final_message needs the last message to be the "
                                     "assistant's")
            extra["continue_final_message"] = True
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                **extra,
            )
        except Exception as e:  # noqa: BLE001 -- templates raise TemplateError, TypeError, ... for bad input
            raise InvalidRequest(f"the chat template refused the messages: {e}"[:500]) from None
        if not isinstance(text, str) or not text:
            raise InvalidRequest("the chat template rendered no text")
        if len(text) > MAX_RENDERED_CHARS:
            raise InvalidRequest(f"the chat template rendered {len(text)} characters; the limit "
                                 f"is {MAX_RENDERED_CHARS}")
        return text

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._require_tokenizer()(text, add_special_tokens=add_special_tokens)["input_ids"]
        return list(ids)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequest("the model has no tokenizer; send prompt_token_ids")
        return self.tokenizer

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        if self.tokenizer is None:  # the scheduler compiles grammars over its vocabulary
            raise InvalidRequest("structured_outputs needs the model's tokenizer, and it has none")
        try:
            check_constraint(params.structured_outputs)
        except GrammarError as e:
            raise InvalidRequest(str(e)) from None

    def _check_vocab(self, token_ids: list[int], name: str) -> None:
        vocab = self.limits.vocab_size
        for i, t in enumerate(token_ids):
            if not 0 <= t < vocab:  # the codec already refused negatives; keep the check whole
                raise InvalidRequest(f"{name}[{i}] = {t} is not in the vocabulary (0..{vocab - 1})")

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        self._check_vocab(params.stop_token_ids, "stop_token_ids")
        self._check_structured_outputs(params)
        vocab = self.limits.vocab_size
        if params.logit_bias and (bad := [t for t in params.logit_bias if not 0 <= t < vocab]):
            raise InvalidRequest(
                f"logit_bias: token id {bad[0]} is not in the vocabulary (0..{vocab - 1})")
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
