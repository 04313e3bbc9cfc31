"""Running one client request through the engine, shared by every frontend API.

Both the native ZMQ API and the HTTP API run a request the same way, so it lives here
once: ``RequestRunner.prepare`` validates and tokenizes a ``GenerateRequest``
(``InputProcessor``; an ``InvalidRequest`` means nothing reached the scheduler),
``RequestRunner.start`` adds it upstream through the ``EngineClient``, and the
returned ``RunningRequest`` turns the scheduler's outputs into client outputs through a
``RequestState`` (detokenization, stop strings). A stop string ends a sample here, so
that sample is aborted at the scheduler; ``abort`` ends samples early (a client cancel,
a client that went away, shutdown) and frees them at the scheduler.

The APIs differ only in how they deliver outputs and notice a vanished client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from services.tokenizer.engine_client import EngineClient, EngineRequest
from services.tokenizer.input_processor import InputProcessor, ProcessedRequest
from services.tokenizer.request_state import RequestState
from shared.protocol import GenerateOutput, GenerateRequest, RequestError


class RequestFailed(Exception):
    """The scheduler rejected or failed the request (its typed ``RequestError``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RunningRequest:
    """One request held at the scheduler, seen from the frontend."""

    def __init__(self, engine: EngineClient, engine_request: EngineRequest,
                 state: RequestState) -> None:
        self._engine = engine
        self.engine_request = engine_request
        self.state = state

    @property
    def request_id(self) -> str:
        """The id on the scheduler link (unique in this frontend)."""
        return self.engine_request.request_id

    @property
    def finished(self) -> bool:
        return self.state.finished

    async def outputs(self) -> AsyncIterator[GenerateOutput]:
        """Client outputs until every sample has finished; raises ``RequestFailed``.

        Samples ended by ``abort`` count as finished; if that ends them all while this
        waits for the scheduler, the caller must stop waiting (cancel its task).
        """
        state = self.state
        while not state.finished:
            event = await self.engine_request.get()
            if isinstance(event, RequestError):
                raise RequestFailed(event.code, event.message)
            absorbed = state.absorb(event)
            # the output goes out before the abort's await, so a caller cancelled there
            # (shutdown) has not lost it
            if absorbed.output is not None:
                yield absorbed.output
            if absorbed.stop_string_hit:  # ended here; the scheduler would keep decoding it
                await self._engine.abort([self.request_id], event.index)

    async def abort(self, indices: Sequence[int] | None = None) -> list[GenerateOutput]:
        """End unfinished samples (all, or ``indices``) here and at the scheduler.

        Returns each ended sample's last output (finish_reason "abort") for the client.
        Idempotent: samples already finished are left alone.
        """
        if indices is None:
            await self._engine.abort([self.request_id])
        else:
            for index in indices:
                await self._engine.abort([self.request_id], index)
        return self.state.abort_unfinished(indices)


class RequestRunner:
    """Validates, tokenizes and starts requests on this process's engine client."""

    def __init__(self, engine: EngineClient, processor: InputProcessor) -> None:
        self.engine = engine
        self.processor = processor

    def prepare(self, req: GenerateRequest) -> ProcessedRequest:
        """Prompt ids and resolved params, or ``InvalidRequest`` (nothing sent upstream)."""
        return self.processor.process(req)

    async def start(self, processed: ProcessedRequest, client_request_id: str,
                    stream: bool) -> RunningRequest:
        params = processed.sampling_params
        engine_request = await self.engine.add(processed.prompt_token_ids, params)
        state = RequestState(client_request_id, engine_request.request_id, params,
                             len(processed.prompt_token_ids), self.processor.tokenizer, stream)
        return RunningRequest(self.engine, engine_request, state)

    async def abort_many(self, runs: Sequence[RunningRequest]) -> list[list[GenerateOutput]]:
        """Abort whole requests with one message upstream (shutdown, a vanished client)."""
        await self.engine.abort([r.request_id for r in runs])
        return [r.state.abort_unfinished() for r in runs]
