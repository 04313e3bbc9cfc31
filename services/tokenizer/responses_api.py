"""OpenAI's Responses API on the HTTP frontend: ``/v1/responses`` routes and response shapes.

- ``POST /v1/responses``: the body (``responses_protocol``) becomes one chat prompt:
  ``instructions``, the stored conversation of ``previous_response_id``, then ``input``;
  its tools go through the core's ``ToolCalling`` as the chat API's do, so ``auto``,
  ``required`` and a named function give the same calls, and ``text.format`` becomes a
  structured-output constraint. ``HttpRequests.generate`` runs it with a
  ``ResponsesBuilder`` as its ``ResponseShape``;
- ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}``: the ``ResponsesStore`` of
  this app (so of this frontend process); an unknown, evicted or expired id is a 404.

``ResponsesBuilder`` shapes one generation as a ``response`` object: output items in
order (an assistant ``message`` with one ``output_text`` part, then ``function_call``
items), ``usage`` (input, cached input and output tokens), ``status`` ``completed``,
``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) or, for an answer
the server aborted, ``cancelled``. Streaming gives OpenAI's typed events, each with
a ``sequence_number`` from 0: ``response.created`` and ``response.in_progress``; per
item ``response.output_item.added``, its deltas (``response.content_part.added`` then
``response.output_text.delta``; ``response.function_call_arguments.delta``) and, at the
end, its ``.done`` events; then ``response.completed`` (``response.incomplete`` when
not completed) with the whole response, as stored. An engine failure mid-stream is an
``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response

from services.tokenizer.http_errors import ApiError, bad_request
from services.tokenizer.http_requests import HttpRequests
from services.tokenizer.input_processor import ChatTurn, InvalidRequest, PromptInput, chat_turn
from services.tokenizer.output_processor import SampleOutput
from services.tokenizer.responses_protocol import ResponsesRequest
from services.tokenizer.responses_store import ResponsesStore, StoredResponse
from services.tokenizer.sse import sse
from services.tokenizer.tool_calls import ToolCallOutput, ToolRequestError

OnFinal = Callable[[dict[str, Any], ChatTurn], None]  # (whole response, its output as a turn)


def install_responses_routes(app: FastAPI, api: HttpRequests, model_of: Callable[[str | None], str],
                             store: ResponsesStore) -> None:
    """Add the Responses API's routes to ``app``; ``store`` keeps its finished responses."""
    tool_calling = api.core.tool_calling

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        model = model_of(body.model)
        body.check()
        history: tuple[ChatTurn, ...] = ()
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            history = previous.conversation
        conversation = (*history, *body.input_turns())
        tools = body.tool_request()
        params = body.sampling_params()
        prompt = PromptInput(params, messages=[*body.instruction_turns(), *conversation],
                             tools=list(tools.tools) if tools is not None else None)
        try:
            prompt, tool_output = tool_calling.prepare(prompt, tools)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None
        response_id = f"resp_{secrets.token_hex(16)}"  # unguessable: GET needs no other key

        def keep(whole: dict[str, Any], output: ChatTurn) -> None:
            if body.store is not False:
                store.put(response_id, StoredResponse(whole, (*conversation, output)))

        builder = ResponsesBuilder(response_id, model, _echo(body, params.temperature,
                                                             params.top_p), tool_output, keep)
        return await api.generate(request, [prompt], builder, bool(body.stream),
                                  on_whole=builder.record)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        found = store.get(response_id)
        if found is None:
            raise not_found(response_id, "response_id")
        return found.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise not_found(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


def not_found(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"no stored response with id '{response_id[:100]}' (responses are kept "
                    "by the frontend that answered them, for a limited time and number, and "
                    "never with store: false)", param=param, code="response_not_found")


def _echo(body: ResponsesRequest, temperature: float, top_p: float) -> dict[str, Any]:
    """The request's settings a response object repeats."""
    fmt = body.text.format if body.text is not None else None
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "store": body.store is not False,
        "temperature": temperature, "top_p": top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                 else {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.function_tools()],
        "truncation": "disabled", "user": body.user, "background": False, "reasoning": None,
    }


def _status(finish_reason: str | None) -> str:
    if finish_reason is None:
        return "in_progress"
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason, "completed")


class ResponsesBuilder:
    """One response's body or events (a ``ResponseShape`` for ``HttpRequests``).

    The answer so far lives in ``_text`` (the message's text), ``_calls`` (each call's
    item id, call id, name and arguments) and ``_order`` (item ids in output order);
    the whole body and the stream's final event are built from them alike.
    """

    def __init__(self, response_id: str, model: str, echo: dict[str, Any],
                 tool_calls: ToolCallOutput | None, on_final: OnFinal) -> None:
        self.response_id, self.model = response_id, model
        self.created_at = int(time.time())
        self._echo = echo
        self._tool_calls = tool_calls  # None: the text is the message
        self._on_final = on_final
        self._msg_id = f"msg_{secrets.token_hex(12)}"
        self._text = ""
        self._calls: dict[str, dict[str, str]] = {}  # item id -> call_id, name, arguments
        self._call_ids: dict[int, str] = {}  # tool call delta index -> item id
        self._order: list[str] = []  # item ids by output_index
        self._finish: str | None = None
        self._usage = (0, 0, 0)  # input, cached input, output tokens
        self._seq = 0  # the next event's sequence_number

    # -- whole ------------------------------------------------------------------------------
    def whole(self, outputs: Sequence[SampleOutput]) -> dict[str, Any]:
        out = outputs[0]  # one prompt, n = 1
        self._note(out)
        text, calls = out.text, []  # calls: OpenAI chat tool_calls entries
        if self._tool_calls is not None:
            message, _ = self._tool_calls.message(text, out.finish_reason)
            text, calls = message["content"] or "", list(message.get("tool_calls") or [])
        self._text = text
        if text or not calls:
            self._order.append(self._msg_id)
        for call in calls:
            self._add_call(call)
        return self._body(_status(self._finish))

    def record(self, whole: dict[str, Any]) -> None:
        """Hand the finished response and its output turn to the owner (the store)."""
        self._on_final(whole, self._output_turn())

    # -- streaming -----------------------------------------------------------------------------
    def events(self, out: SampleOutput) -> list[str]:
        events = []
        if self._seq == 0:
            shell = self._body("in_progress")
            events += [self._event("response.created", response=shell),
                       self._event("response.in_progress", response=shell)]
        self._note(out)
        content, entries = out.text, []
        if self._tool_calls is not None:
            delta, _ = self._tool_calls.delta(0, out.text, out.finish_reason)
            content, entries = delta.get("content", ""), delta.get("tool_calls", [])
        if content:
            events += self._text_delta(content)
        for entry in entries:
            events += self._call_delta(entry)
        if out.finish_reason is not None:
            events += self._close_items()
        return events

    def closing_events(self) -> list[str]:
        status = _status(self._finish)
        whole = self._body(status)
        self.record(whole)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [self._event(kind, response=whole)]

    def error_events(self, error: ApiError) -> list[str]:
        failed = self._body("failed")
        failed["error"] = {"code": "server_error", "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    def _text_delta(self, content: str) -> list[str]:
        events = [] if self._msg_id in self._order else self._open_message()
        self._text += content
        events.append(self._event("response.output_text.delta", item_id=self._msg_id,
                                  output_index=self._order.index(self._msg_id), content_index=0,
                                  delta=content, logprobs=[]))
        return events

    def _open_message(self) -> list[str]:
        self._order.append(self._msg_id)
        index = len(self._order) - 1
        return [self._event("response.output_item.added", output_index=index,
                            item=self._message_item("in_progress", parts=[])),
                self._event("response.content_part.added", item_id=self._msg_id,
                            output_index=index, content_index=0, part=_text_part(""))]

    def _call_delta(self, entry: dict[str, Any]) -> list[str]:
        """One ``delta.tool_calls`` entry of the chat shape: a new call (with an id) or
        more of a call's arguments."""
        events = []
        if "id" in entry:
            item_id = self._add_call({**entry, "function": {**entry["function"], "arguments": ""}})
            self._call_ids[entry["index"]] = item_id
            events.append(self._event("response.output_item.added",
                                      output_index=len(self._order) - 1,
                                      item=self._call_item(item_id, "in_progress")))
        item_id = self._call_ids[entry["index"]]
        arguments = entry["function"].get("arguments") or ""
        if arguments:
            self._calls[item_id]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item_id,
                                      output_index=self._order.index(item_id), delta=arguments))
        return events

    def _close_items(self) -> list[str]:
        """Every item's ``.done`` events (an answer with no text and no call is an empty
        message, as in the whole body)."""
        events = [] if self._order else self._open_message()
        status = "completed" if _status(self._finish) == "completed" else "incomplete"
        for index, item_id in enumerate(self._order):
            if item_id == self._msg_id:
                events += [
                    self._event("response.output_text.done", item_id=item_id, output_index=index,
                                content_index=0, text=self._text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item_id,
                                output_index=index, content_index=0, part=_text_part(self._text)),
                    self._event("response.output_item.done", output_index=index,
                                item=self._message_item(status))]
            else:
                events += [
                    self._event("response.function_call_arguments.done", item_id=item_id,
                                output_index=index, arguments=self._calls[item_id]["arguments"]),
                    self._event("response.output_item.done", output_index=index,
                                item=self._call_item(item_id, status))]
        return events

    # -- shapes ------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(data, event=kind)

    def _note(self, out: SampleOutput) -> None:
        self._usage = (out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
        if out.finish_reason is not None:
            self._finish = out.finish_reason

    def _add_call(self, call: dict[str, Any]) -> str:
        item_id = f"fc_{secrets.token_hex(12)}"
        function = call["function"]
        self._calls[item_id] = {"call_id": call["id"], "name": function["name"],
                                "arguments": function["arguments"]}
        self._order.append(item_id)
        return item_id

    def _message_item(self, status: str, parts: list[Any] | None = None) -> dict[str, Any]:
        return {"id": self._msg_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(self._text)] if parts is None else parts}

    def _call_item(self, item_id: str, status: str) -> dict[str, Any]:
        return {"id": item_id, "type": "function_call", "status": status, **self._calls[item_id]}

    def _body(self, status: str) -> dict[str, Any]:
        done = status not in ("in_progress", "failed")
        item_status = "completed" if status == "completed" else "incomplete"
        output = [self._message_item(item_status) if item_id == self._msg_id
                  else self._call_item(item_id, item_status) for item_id in self._order]
        input_tokens, cached, output_tokens = self._usage
        usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": output_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": input_tokens + output_tokens}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self._finish == "length"
            else None,
            "model": self.model, "output": output if status != "in_progress" else [],
            "usage": usage if done else None, **self._echo,
        }

    def _output_turn(self) -> ChatTurn:
        """The answer as the assistant turn a continuation's history gets."""
        calls = [(c["call_id"], c["name"], c["arguments"]) for c in self._calls.values()]
        content = self._text if self._text or not calls else None
        try:
            return chat_turn("output", "assistant", content, calls)
        except InvalidRequest:  # arguments cut short by max_output_tokens: kept as text
            return ChatTurn("assistant", content, tuple(
                {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, n, a in calls))


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
