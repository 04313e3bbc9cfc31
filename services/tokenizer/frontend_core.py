"""The frontend core every API of a frontend process shares: tokenizer + engine client.

An API validates what its client sent as ``PromptInput``s (``validate``: nothing
reaches the scheduler unless every prompt is valid), then ``submit``s them as one
``ClientRequest``: each prompt becomes an engine request whose ``RequestState`` feeds
that client request's one sink. The HTTP API reads a ``QueuedRequest`` (an asyncio
queue); the native API gives a sink that writes into its socket outbox. Either way a
token goes from the engine client's receive loop to the API's writer through one
queue, with no task per request or per prompt.

``abort`` ends a client request's unfinished samples here and at the scheduler.

Validation (chat template rendering, tokenization) runs on a small thread pool with a
deadline (``prepare_timeout_s``): a template that takes long on some input, or a huge
prompt, answers that client with a 400 in bounded time while the event loop keeps
serving everyone else. The tokenizer is only read there (no truncation or padding is
ever set on it), so concurrent encodes are safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.tokenizer.engine_client import EngineClient
from services.tokenizer.engine_stats import EngineStatsView
from services.tokenizer.input_processor import (
    InputProcessor,
    InvalidRequest,
    ProcessedPrompt,
    PromptInput,
)
from services.tokenizer.output_processor import (
    OutputItem,
    RequestFailed,
    RequestState,
    SampleOutput,
)
from services.tokenizer.tool_calls import ToolCalling
from shared.codec import MalformedFrameCounter

PREPARE_TIMEOUT_S = 10.0  # render + tokenize of one client request
PREPARE_THREADS = 4
_T = TypeVar("_T")


class ClientRequest:
    """One client request at the engine: its prompts' engine requests, one sink.

    ``put`` is the sink: it counts finished samples, then hands the item on.
    """

    def __init__(self, num_samples: int, deliver: Callable[[OutputItem], None]) -> None:
        self.engine_request_ids: list[str] = []
        self._open = num_samples  # samples whose final output has not come
        self._deliver = deliver
        self.failed = False

    @property
    def finished(self) -> bool:
        return self._open <= 0

    def put(self, item: OutputItem) -> None:
        if isinstance(item, RequestFailed):
            self.failed, self._open = True, 0
        elif item.finish_reason is not None:
            self._open -= 1
        self._deliver(item)


class QueuedRequest(ClientRequest):
    """A client request read through one asyncio queue (the HTTP API)."""

    def __init__(self, num_samples: int) -> None:
        self._queue: asyncio.Queue[OutputItem] = asyncio.Queue()
        super().__init__(num_samples, self._queue.put_nowait)
        self._unread = num_samples

    async def next(self) -> SampleOutput | None:
        """The next output of any prompt; None once every sample ended; raises
        ``RequestFailed`` when the scheduler failed one of the prompts."""
        if self._unread <= 0:
            return None
        item = await self._queue.get()
        if isinstance(item, RequestFailed):
            self._unread = 0
            raise item
        if item.finish_reason is not None:
            self._unread -= 1
        return item

    async def collect(self) -> list[SampleOutput]:
        outputs = []
        while (item := await self.next()) is not None:
            outputs.append(item)
        return outputs


@dataclass
class FrontendCore:
    """What every API of the process shares: one tokenizer, one scheduler link."""

    frontend_id: str
    processor: InputProcessor
    engine: EngineClient
    counter: MalformedFrameCounter
    stats: EngineStatsView  # engine liveness (/health) and figures (/metrics)
    served_model_names: tuple[str, ...]  # what requests may name as their model
    # the tool call format (--tool-call-parser) both APIs parse calls with
    tool_calling: ToolCalling = field(default_factory=lambda: ToolCalling(None))
    prepare_timeout_s: float = PREPARE_TIMEOUT_S
    _prepare_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare"),
        repr=False)

    @property
    def tokenizer(self) -> Any | None:
        return self.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.processor.limits.max_model_len

    async def validate(self, inputs: Sequence[PromptInput]) -> list[ProcessedPrompt]:
        """Every prompt tokenized and checked, or ``InvalidRequest`` (nothing sent)."""
        return await self.bounded(self.processor.process_all, list(inputs))

    async def bounded(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` (rendering, tokenizing) on the prepare pool, within
        ``prepare_timeout_s`` or ``InvalidRequest``. A call past the deadline runs on to
        its end in its thread (a thread cannot be stopped; the input bounds bound it)."""
        future = asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.prepare_timeout_s)
        except TimeoutError:
            raise InvalidRequest(f"rendering and tokenizing the prompt took over "
                                 f"{self.prepare_timeout_s:g} s") from None

    async def submit(self, prompts: Sequence[ProcessedPrompt], stream: bool,
                     request: ClientRequest) -> ClientRequest:
        """Start every prompt at the scheduler, feeding ``request``."""
        try:
            for i, prompt in enumerate(prompts):
                params = prompt.sampling_params
                rid = self.engine.new_request_id()
                state = RequestState(rid, i, params, len(prompt.prompt_token_ids), self.tokenizer,
                                     stream, request, prompt.prompt_token_ids,
                                     skip_special_tokens=prompt.skip_special_tokens)
                await self.engine.add(state, prompt.prompt_token_ids, params)
                request.engine_request_ids.append(rid)
        except BaseException:
            await self.abort(request, deliver=False)
            raise
        return request

    async def abort(self, request: ClientRequest, indices: Sequence[int] | None = None,
                    deliver: bool = True) -> None:
        """End unfinished samples (all, or these sample indices of every prompt) here and
        at the scheduler; their final outputs reach the sink unless ``deliver`` is false."""
        ids = request.engine_request_ids
        if indices is None:
            await self.engine.abort(ids, None, deliver)
        else:
            for index in indices:
                await self.engine.abort(ids, index, deliver)
