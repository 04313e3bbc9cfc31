"""vLLM's request extensions through a live `pagoda serve` and the official ``openai``
client (extra_body): ``return_token_ids``, ``stream_options.continuous_usage_stats``,
``truncate_prompt_tokens``, ``add_special_tokens``, ``include_stop_str_in_output``,
chat ``echo`` / ``add_generation_prompt`` / ``continue_final_message`` /
``chat_template_kwargs``, and ``/tokenize``'s ``add_special_tokens`` and
``return_token_strs``. Oracles: the HF tokenizer (the same template call, the same
tokens) and the engine's own greedy answer to the equivalent plain request.

The model is SmolLM2 with the Hermes tool template plus a ``persona`` variable, so
``chat_template_kwargs`` has something to change. The stack runs with ``--api-key``,
``--api-key-file`` and ``--allowed-origins``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagoda.client import Client, InvalidRequestError
from support.live_stack import LiveStack, assert_idle_and_clean, openai_client, serving
from support.tool_model import TOOL_TEMPLATE, make_tool_model

pytestmark = pytest.mark.slow

TEMPLATE = "{%- if persona %}{{- 'Persona: ' + persona + '\\n' }}{%- endif %}\n" + TOOL_TEMPLATE
ASK = [{"role": "user", "content": "Name three colours."}]
PARTIAL = [*ASK, {"role": "assistant", "content": "Red, green and"}]
KEY = "unused"  # the key support.live_stack's openai client sends
FILE_KEYS = ("team-key-1", "team-key-2")
ORIGIN = "https://app.example"
TEXT = "The quick brown fox jumps over the lazy dog because the dog was sleeping in the sun"


@pytest.fixture(scope="module")
def model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tool_model(smollm2_dir, tmp_path_factory.mktemp("ext-model") / "smollm2-ext",
                           TEMPLATE)


@pytest.fixture(scope="module")
def stack(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("ext-serve")
    key_file = tmp / "keys"
    key_file.write_text(f"# team keys\n{FILE_KEYS[0]}\n\n{FILE_KEYS[1]}\n")
    key_file.chmod(0o600)
    with serving(model, tmp / "serve.log", 1, "--num-kv-blocks", "256", "--max-model-len",
                 "1024", "--served-model-name", "smollm2", "--api-key", KEY,
                 "--api-key-file", str(key_file), "--allowed-origins", ORIGIN) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: LiveStack) -> openai.OpenAI:
    return openai_client(stack)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """HF's tokens for a chat: the template, then the text without added special tokens."""
    kwargs.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize(stack: LiveStack, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{stack.http.removesuffix('/v1')}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_return_token_ids(stack: LiveStack, client: openai.OpenAI, tokenizer: Any) -> None:
    after = len(stack.log())
    extra = {"return_token_ids": True}
    r = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=8, temperature=0,
                                  extra_body=extra).model_dump()
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == tokenizer(TEXT)["input_ids"]
    assert len(choice["token_ids"]) == r["usage"]["completion_tokens"] == 8
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = [c.model_dump() for c in client.completions.create(
        model="smollm2", prompt=TEXT, max_tokens=8, temperature=0, stream=True, extra_body=extra)]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] or c["choices"][0]["prompt_token_ids"]
               is None for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"] or []] == choice["token_ids"]

    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=6,
                                       temperature=0, extra_body=extra).model_dump()
    assert r["prompt_token_ids"] == chat_ids(tokenizer, ASK)
    assert tokenizer.decode(r["choices"][0]["token_ids"]) == r["choices"][0]["message"]["content"]
    chunks = [c.model_dump() for c in client.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=6, temperature=0, stream=True, extra_body=extra)]
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == (
        r["choices"][0]["token_ids"])
    assert_idle_and_clean(stack, after)


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    kwargs = {"model": "smollm2", "prompt": TEXT, "max_tokens": 6, "temperature": 0,
              "stream": True}
    chunks = list(client.completions.create(
        **kwargs, stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    counts = [u.completion_tokens for u in usages if u is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    assert {u.prompt_tokens for u in usages if u is not None} == {usages[-1].prompt_tokens}  # type: ignore[union-attr]
    plain = list(client.completions.create(
        **kwargs, extra_body={"stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": False}}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_truncate_prompt_tokens(stack: LiveStack, client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    r = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    same = client.completions.create(model="smollm2", prompt=ids[-5:], max_tokens=8,
                                     temperature=0)
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == same.choices[0].text
    whole = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    with Client(stack.frontends[0]) as native:
        got = native.generate(TEXT, max_tokens=8, temperature=0, truncate_prompt_tokens=5)
        assert got.usage.prompt_tokens == 5 and got.outputs[0].text == same.choices[0].text
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
            native.generate(TEXT, max_tokens=1, truncate_prompt_tokens=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=TEXT, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_chat_template_options(stack: LiveStack, client: openai.OpenAI, tokenizer: Any) -> None:
    """continue_final_message, add_generation_prompt and chat_template_kwargs reach the
    template exactly as HF's apply_chat_template takes them (same tokens), and echo puts
    the continued message before the answer."""
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    want = chat_ids(tokenizer, PARTIAL, **cont)
    assert tokenize(stack, messages=PARTIAL, **cont)["tokens"] == want
    r = client.chat.completions.create(model="smollm2", messages=PARTIAL, max_tokens=8,
                                       temperature=0, extra_body={**cont, "echo": True})
    assert r.usage.prompt_tokens == len(want)
    plain = client.completions.create(model="smollm2", prompt=want, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == "Red, green and" + plain.choices[0].text
    kwargs = {"persona": "a pirate"}
    want = chat_ids(tokenizer, ASK, **kwargs)
    assert tokenize(stack, messages=ASK, chat_template_kwargs=kwargs)["tokens"] == want
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": kwargs})
    assert r.usage.prompt_tokens == len(want) > len(chat_ids(tokenizer, ASK))
    no_prompt = chat_ids(tokenizer, ASK, add_generation_prompt=False)
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(no_prompt)
    with Client(stack.frontends[0]) as native:
        got = native.generate(messages=PARTIAL, max_tokens=8, temperature=0, **cont)
        assert got.outputs[0].text == plain.choices[0].text
    bad = [({"add_generation_prompt": True, "continue_final_message": True}, "both"),
           ({"chat_template_kwargs": {"tools": []}}, "may not set tools")]
    for extra, match in bad:
        with pytest.raises(openai.BadRequestError, match=match):
            client.chat.completions.create(model="smollm2", messages=PARTIAL, max_tokens=1,
                                           extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="assistant"):
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=1,
                                       extra_body=cont)


def test_special_tokens_and_stop_strings(stack: LiveStack, client: openai.OpenAI,
                                         tokenizer: Any) -> None:
    got = tokenize(stack, prompt=TEXT, return_token_strs=True)
    assert got["tokens"] == tokenizer(TEXT)["input_ids"]
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    marked = "<|im_start|>user\nhi"
    assert tokenize(stack, prompt=marked, add_special_tokens=False)["tokens"] == (
        tokenizer(marked, add_special_tokens=False)["input_ids"])
    assert tokenize(stack, messages=ASK, add_special_tokens=True)["tokens"] == (
        tokenizer(tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=True)["input_ids"])
    base = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text.strip().split()[1]
    kept = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=12, temperature=0,
                                     stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"
    eos = "<|im_end|>"
    special = client.completions.create(model="smollm2", prompt=TEXT, max_tokens=1,
                                        temperature=0, logit_bias={
                                            str(tokenizer.convert_tokens_to_ids(eos)): 100},
                                        extra_body={"skip_special_tokens": False,
                                                    "ignore_eos": True})
    assert special.choices[0].text == eos
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2", prompt=TEXT, max_tokens=1,
                                  extra_body={"no_such_option": 1})
    assert e.value.body["param"] == "no_such_option"  # type: ignore[index]


def test_api_key(stack: LiveStack) -> None:
    root = stack.http.removesuffix("/v1")
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                    {"Authorization": KEY}):
        r = httpx.post(f"{stack.http}/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.post(f"{stack.http}/completions", json=body, headers=headers).status_code == 200
    assert httpx.get(f"{stack.http}/models").status_code == 401
    assert httpx.get(f"{root}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{root}/metrics").status_code == 200
    assert httpx.get(f"{root}/openapi.json").status_code == 401  # not an open path
    assert httpx.get(f"{root}/openapi.json", headers={"x-api-key": KEY}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.http, api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{stack.http}/messages", json={"model": "smollm2", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{stack.http}/messages", headers={"x-api-key": KEY}, json={
        "model": "smollm2", "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    for key in FILE_KEYS:
        assert httpx.post(f"{stack.http}/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert KEY not in stack.log()  # never logged


def test_cors(stack: LiveStack) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{stack.http}/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.options(f"{stack.http}/chat/completions",
                      headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{stack.http}/models", headers={"Origin": ORIGIN, "x-api-key": KEY})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
