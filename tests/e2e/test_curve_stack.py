"""`pagoda serve --curve-keys DIR` (issue 23): every ZMQ link of the stack under CURVE.

The stack answers over HTTP and over the native API to a client that holds an allow-
listed key; a native client without keys, a subscriber without keys and one whose key
is not in the allow-list all read nothing, and the scheduler logs the refused key.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from pagoda.client import Client, PagodaError
from shared.curve import SERVER_PUBLIC, CurveKeys, generate_keys
from shared.ipc import make_socket
from support.live_stack import LiveStack, served_client, serving

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_keys(tmp_path_factory.mktemp("curve") / "keys")


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, keys_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with serving(smollm2_dir, tmp_path_factory.mktemp("serve") / "serve.log", 1,
                 "--num-kv-blocks", "256", "--max-model-len", "1024",
                 "--curve-keys", str(keys_dir)) as s:
        yield s


def stranger_keys(keys_dir: Path, tmp_path: Path) -> CurveKeys:
    """A client key pair of its own (in no allow-list), aimed at the stack's server key."""
    own = generate_keys(tmp_path / "stranger")
    (own / SERVER_PUBLIC).unlink()
    (own / SERVER_PUBLIC).write_bytes((keys_dir / SERVER_PUBLIC).read_bytes())
    return CurveKeys.load(own)


def test_the_stack_serves_http_and_an_allow_listed_native_client(
        stack: LiveStack, keys_dir: Path) -> None:
    client = served_client(stack)
    http = client.completions.create(model=client.model, prompt=PROMPT,  # type: ignore[attr-defined]
                                     max_tokens=8, temperature=0)
    with Client(stack.frontends[0], timeout=60, curve_keys=keys_dir) as native:
        result = native.generate(PROMPT, max_tokens=8, temperature=0)
    assert result.outputs[0].text == http.choices[0].text and result.outputs[0].text


def test_a_native_client_without_keys_gets_no_answer(stack: LiveStack) -> None:
    with Client(stack.frontends[0], timeout=3) as native, pytest.raises(PagodaError):
        native.generate(PROMPT, max_tokens=4, temperature=0)


def test_the_step_stream_is_unreadable_without_an_allow_listed_key(
        stack: LiveStack, keys_dir: Path, tmp_path: Path) -> None:
    """While requests run (steps are published), neither a plain subscriber nor one with
    a key outside the allow-list gets a frame; the scheduler logs the refused key."""
    ctx: zmq.Context[Any] = zmq.Context()
    plain = make_socket(ctx, zmq.SUB, stack.scheduler["step"])
    stranger = make_socket(ctx, zmq.SUB, stack.scheduler["step"],
                           curve=stranger_keys(keys_dir, tmp_path))
    client = served_client(stack)
    done = threading.Event()

    def traffic() -> None:
        while not done.is_set():
            client.completions.create(model=client.model, prompt=PROMPT,  # type: ignore[attr-defined]
                                      max_tokens=16, temperature=0)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        deadline = time.monotonic() + 4
        poller = zmq.Poller()
        poller.register(plain, zmq.POLLIN)
        poller.register(stranger, zmq.POLLIN)
        got: dict[Any, int] = {}
        while time.monotonic() < deadline:
            got.update(poller.poll(200))
        assert got == {}
    finally:
        done.set()
        worker.join()
        plain.close(linger=0)
        stranger.close(linger=0)
        ctx.term()
    stack.wait_for_log(lambda t: "refused a peer whose client key is not in the allow-list" in t,
                       timeout=10)


@pytest.mark.parametrize(("role", "missing"), [
    ("scheduler", "server.key_secret"), ("frontend", "server.key_secret"),
    ("worker", "client.key_secret"),
])
def test_a_role_without_its_key_file_refuses_to_start(
        role: str, missing: str, smollm2_dir: Path, keys_dir: Path, tmp_path: Path) -> None:
    """Each role checks the files it needs before it opens a socket: exit 2, naming the
    missing file (a worker needs the client pair, a binding role the server pair)."""
    partial = tmp_path / "partial"
    shutil.copytree(keys_dir, partial)
    (partial / missing).unlink()
    run = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", role, "--model", str(smollm2_dir),
         "--curve-keys", str(partial)],
        check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"{partial / missing}: no such key file" in run.stderr
