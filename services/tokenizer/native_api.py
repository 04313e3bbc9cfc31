"""The frontend's native API: a ROUTER that ``pagoda.client`` connects DEALERs to.

Clients send ``GenerateRequest`` and ``AbortRequest`` (their own request ids, scoped
per client connection: the key of a request is (client identity, client request id)).
A ``GenerateRequest`` becomes a ``PromptInput``, is validated by the ``FrontendCore``
(a bad request gets a typed ``RequestError`` and nothing reaches the scheduler) and
submitted as one ``ClientRequest`` whose sink writes into this API's outbox. One
sender task drains the outbox to the ROUTER as ``GenerateOutput``s: a token reaches the
client through that one queue, with no task per request.

Sends never wait on a client: they use NOBLOCK on a ROUTER_MANDATORY socket, so a
client that vanished (EHOSTUNREACH) or stopped reading until its pipe filled (EAGAIN)
fails the send at once; every request of that client is then aborted at the scheduler.
A vanished client is noticed at the first output sent to it after it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import zmq
import zmq.asyncio

from services.tokenizer.frontend_core import ClientRequest, FrontendCore
from services.tokenizer.input_processor import InvalidRequest, PromptInput, chat_turn
from services.tokenizer.output_processor import OutputItem, RequestFailed, SampleOutput
from services.tokenizer.tool_calls import (
    ToolCallOutput,
    ToolRequest,
    ToolRequestError,
    tool_request,
)
from shared.codec import encode, safe_decode
from shared.curve import CurveKeys
from shared.ipc import make_socket
from shared.protocol import (
    CLIENT_TO_FRONTEND,
    AbortRequest,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    ToolCall,
    ToolFunction,
)

log = logging.getLogger("pagoda.frontend.native")

MAX_REQUEST_ID_CHARS = 256
ClientKey = tuple[bytes, str]  # (client identity, client request id)
_Outgoing = tuple[bytes, GenerateOutput | RequestError]  # (client identity, message)


def prompt_input(req: GenerateRequest) -> PromptInput:
    """The frontend's view of a native request (the wire type stays on this link)."""
    if not req.request_id or len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} characters")
    if (req.tools or req.tool_choice is not None) and req.messages is None:
        raise InvalidRequest("tools and tool_choice need messages (a chat request)")
    messages = None
    if req.messages is not None:
        messages = [chat_turn(f"messages[{i}]", m.role, m.content,
                              [(c.id or "", c.name or "", c.arguments) for c in m.tool_calls],
                              m.tool_call_id, m.name)
                    for i, m in enumerate(req.messages)]
    return PromptInput(req.sampling_params, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                       messages=messages, add_generation_prompt=req.add_generation_prompt,
                       tools=template_tools(req.tools), add_special_tokens=req.add_special_tokens,
                       continue_final_message=req.continue_final_message,
                       chat_template_kwargs=req.chat_template_kwargs)


def template_tools(tools: list[ToolFunction]) -> list[dict[str, Any]] | None:
    """The tools in OpenAI's shape, as chat templates and ``tool_request`` take them."""
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in (
        ("name", t.name), ("description", t.description), ("parameters", t.parameters))
        if v is not None}} for t in tools]


def tool_request_of(req: GenerateRequest, prompt: PromptInput) -> ToolRequest | None:
    named = req.tool_choice
    if named == "function":
        named = {"type": "function", "function": {"name": req.tool_function}}
    return tool_request(prompt.tools, named, req.parallel_tool_calls)


def generate_output(client_request_id: str, out: SampleOutput, stream: bool,
                    tools: ToolCallOutput | None) -> GenerateOutput:
    stop = out.stop_reason
    text, finish_reason, calls = out.text, out.finish_reason, []
    if tools is not None:
        if stream:
            shaped, finish_reason = tools.delta(out.index, out.text, finish_reason)
        else:
            shaped, finish_reason = tools.message(out.text, finish_reason)
        text = shaped.get("content") or ""
        calls = [ToolCall(entry.get("index", i), entry.get("id"), entry["function"].get("name"),
                          entry["function"].get("arguments", ""))
                 for i, entry in enumerate(shaped.get("tool_calls", ()))]
    return GenerateOutput(
        request_id=client_request_id, index=out.index, text=text, token_ids=out.token_ids,
        logprobs=out.logprobs, finish_reason=finish_reason,
        stop_reason=None if stop is None else str(stop),
        num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
        prompt_token_ids=out.prompt_token_ids or [], prompt_logprobs=out.prompt_logprobs or [],
        tool_calls=calls,
    )


class NativeApi:
    """The native ZMQ API of one frontend process."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        core: FrontendCore,
        *,
        hwm: int | None = None,
        allow_wildcard: bool = False,
        curve: CurveKeys | None = None,
    ) -> None:
        opts: dict[str, Any] = {} if hwm is None else {"sndhwm": hwm, "rcvhwm": hwm}
        self.address = address
        self._sock = make_socket(ctx, zmq.ROUTER, address, allow_wildcard=allow_wildcard,
                                 curve=curve, **opts)
        self._core = core
        self._inflight: dict[ClientKey, ClientRequest] = {}
        self._outbox: asyncio.Queue[_Outgoing] = asyncio.Queue()
        self._accepting = True

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def stop_accepting(self) -> None:
        """New requests are answered ``overloaded`` from now on; in-flight ones go on."""
        self._accepting = False

    async def abort_all(self) -> None:
        """Shutdown: end every in-flight request (clients get finish_reason "abort")."""
        for request in list(self._inflight.values()):
            await self._core.abort(request)
        await self._flush()

    async def close(self) -> None:
        self._inflight.clear()
        self._sock.close()  # linger flushes the last outputs
        if self.address.startswith("ipc://"):  # libzmq 4.3 leaves the socket file behind
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("ipc://"):])

    async def serve(self) -> None:
        """The receive loop and the sender; runs until cancelled, never raises otherwise."""
        sender = asyncio.get_running_loop().create_task(self._send_loop(), name="native-send")
        try:
            await self._receive_loop()
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender

    async def _receive_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.warning("native API receive failed: %s", e)
                continue
            msg = safe_decode(frames, CLIENT_TO_FRONTEND, self._core.counter, num_frames=2)
            if msg is None:
                continue
            identity = frames[0].bytes
            try:
                if isinstance(msg, GenerateRequest):
                    await self._on_generate(identity, msg)
                else:
                    await self._on_abort(identity, msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # one request's failure must not end the loop
                log.exception("native API: handling a %s failed", type(msg).__name__)

    # -- client messages ----------------------------------------------------------------
    async def _on_generate(self, identity: bytes, req: GenerateRequest) -> None:
        key = (identity, req.request_id)
        if not self._accepting:
            self._reply_error(key, "overloaded", "this frontend is shutting down; retry on another")
            return
        if key in self._inflight:
            self._reply_error(key, "invalid_request", f"request_id {req.request_id!r} is already in flight")
            return
        try:
            prompt = prompt_input(req)
            prompt, tools = self._core.tool_calling.prepare(prompt, tool_request_of(req, prompt))
            prompts = await self._core.validate([prompt])
        except InvalidRequest as e:
            self._reply_error(key, e.code, str(e))
            return
        except ToolRequestError as e:
            self._reply_error(key, "invalid_request", f"{e.param}: {e}")
            return
        stream = req.stream

        def deliver(item: OutputItem) -> None:  # called by ClientRequest.put after it counted
            if request.finished:
                self._inflight.pop(key, None)
            if isinstance(item, RequestFailed):
                self._reply_error(key, item.code, item.message)
            else:
                self._outbox.put_nowait(
                    (identity, generate_output(req.request_id, item, stream, tools)))

        request = ClientRequest(req.sampling_params.n, deliver)
        self._inflight[key] = request
        try:
            await self._core.submit(prompts, stream, request)
        except BaseException:
            self._inflight.pop(key, None)
            raise

    async def _on_abort(self, identity: bytes, msg: AbortRequest) -> None:
        for client_id in msg.request_ids:
            request = self._inflight.get((identity, client_id))
            if request is None:
                continue  # finished already, or never ours: aborting is idempotent
            await self._core.abort(request, None if msg.index is None else [msg.index])

    # -- sending ------------------------------------------------------------------------
    def _reply_error(self, key: ClientKey, code: str, message: str) -> None:
        self._outbox.put_nowait((key[0], RequestError(key[1], code, message)))

    async def _send_loop(self) -> None:
        while True:
            await self._send_one(*await self._outbox.get())

    async def _flush(self) -> None:
        """Send what is queued now (shutdown, before the loop is cancelled)."""
        while not self._outbox.empty():
            await self._send_one(*self._outbox.get_nowait())

    async def _send_one(self, identity: bytes, msg: GenerateOutput | RequestError) -> None:
        try:
            await self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
            return
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                why = "disconnected"
            elif e.errno == zmq.EAGAIN:
                why = "is too slow (its pipe is full)"
            else:
                why = f"send failed ({e})"
        await self._drop_client(identity, why)

    async def _drop_client(self, identity: bytes, why: str) -> None:
        keys = [k for k in self._inflight if k[0] == identity]
        for k in keys:
            await self._core.abort(self._inflight.pop(k), deliver=False)
        if keys:
            log.warning("client %s %s: aborted its %d request(s)", identity.hex()[:16], why,
                        len(keys))
