"""deploy/sglang-gateway/compose.yaml must be true: two `pagoda serve` replicas behind the
real SGLang Model Gateway (the ``sglang-router`` package), started as local processes from
the commands the file names (as tests/e2e/test_compose.py does for compose.yaml).

Service names become 127.0.0.1 and each published or internal port a free local one. Through
the gateway: greedy answers equal a replica's own (fp32, the same model), streaming works,
and the cache_aware policy sends a repeated prompt to the replica that served it before
(the frontends' pids, which response ids carry, tell the replicas apart).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from pagoda.model_fetch import default_cache_dir
from support.live_stack import REPO, free_port

pytestmark = pytest.mark.slow
DEPLOY = REPO / "deploy" / "sglang-gateway"
PROMPT = ("You are a careful assistant. Answer in one short sentence. Question: what colour is "
          "the sky on a clear day, and why does it look that way to us?")


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load_compose() -> dict[str, Any]:
    return yaml.load((DEPLOY / "compose.yaml").read_text(), Loader=_ComposeLoader)


def test_gateway_file_shape() -> None:
    compose = load_compose()
    services = compose["services"]
    assert set(services) == {"replica-a", "replica-b", "gateway"}
    for name in ("replica-a", "replica-b"):
        assert services[name]["command"][:2] == ["pagoda", "serve"]
        assert "ports" not in services[name]  # only the gateway is published
        assert "healthcheck" in services[name]
    gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for n in ("replica-a", "replica-b")]
    assert gpus[0] != gpus[1]  # one device each
    gateway = services["gateway"]
    assert gateway["ports"] == ["127.0.0.1:30000:30000"]
    cmd = gateway["command"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert "sglang-router==" in (DEPLOY / "Dockerfile.gateway").read_text()
    cpu = yaml.load((DEPLOY / "compose.cpu.yaml").read_text(), Loader=_ComposeLoader)
    assert set(cpu["services"]) == {"replica-a", "replica-b"}


def _replica_command(cmd: list[str], port: int) -> list[str]:
    assert cmd[:2] == ["pagoda", "serve"], cmd
    out = [sys.executable, "-m", "pagoda.cli", *cmd[1:]]
    out[out.index("--http-port") + 1] = str(port)
    out[out.index("--http-host") + 1] = "127.0.0.1"
    return out


def _gateway_command(cmd: list[str], ports: dict[str, int]) -> list[str]:
    assert cmd[:3] == ["python", "-m", "sglang_router.launch_router"], cmd
    out = [sys.executable, *cmd[1:]]
    out = [re.sub(r"http://(replica-[ab]):8000", lambda m: f"http://127.0.0.1:{ports[m.group(1)]}",
                  x) for x in out]
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(ports["gateway"])
    out[out.index("--prometheus-port") + 1] = str(ports["metrics"])
    return out


def _wait(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert all(p.poll() is None for p in procs), "a process exited while starting"
        time.sleep(0.2)  # polling the health probe, as compose does
    raise AssertionError(f"{url} never answered 200")


def _pids(log: Path) -> set[str]:
    """The replica's frontend pids, in hex as response ids carry them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(r"processes:(.*)", log.read_text(errors="replace"))
        if m:
            return {f"{int(pid):x}" for name, pid in re.findall(r"(\S+)=(\d+)", m.group(1))
                    if name.startswith("frontend")}
        time.sleep(0.1)  # waiting for the launcher's line
    raise AssertionError(log.read_text())


def test_two_replicas_behind_the_sglang_gateway(smollm2_dir: Path, tmp_path: Path) -> None:
    services = load_compose()["services"]
    ports = {"replica-a": free_port(), "replica-b": free_port(), "gateway": free_port(),
             "metrics": free_port()}
    env = {**os.environ, "PAGODA_CACHE": str(default_cache_dir()), "PAGODA_DTYPE": "float32",
           "PAGODA_TESTING": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("replica-a", "replica-b"):
            svc = services[name]
            with open(tmp_path / f"{name}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    _replica_command(svc["command"], ports[name]),
                    env={**env, **{k: str(v) for k, v in svc["environment"].items()
                                   if k != "PAGODA_CACHE"}},
                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        for name in ("replica-a", "replica-b"):
            _wait(f"http://127.0.0.1:{ports[name]}/health", procs)
        owner = {pid: name for name in ("replica-a", "replica-b")
                 for pid in _pids(tmp_path / f"{name}.log")}
        with open(tmp_path / "gateway.log", "wb") as log:
            procs.append(subprocess.Popen(
                _gateway_command(services["gateway"]["command"], ports), env=env, cwd=REPO,
                stdout=log, stderr=subprocess.STDOUT))
        _wait(f"http://127.0.0.1:{ports['gateway']}/health", procs, timeout=60)

        gateway = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['gateway']}/v1",
                                api_key="unused", max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['replica-a']}/v1",
                               api_key="unused", max_retries=0, timeout=120)
        kwargs: dict[str, Any] = {"model": "smollm2", "max_tokens": 12, "temperature": 0}
        served_by = []
        for _ in range(4):
            got = gateway.completions.create(prompt=PROMPT, **kwargs)
            served_by.append(owner[got.id.split("-")[1]])
            assert got.choices[0].text == direct.completions.create(
                prompt=PROMPT, **kwargs).choices[0].text
        assert len(set(served_by)) == 1, served_by  # cache_aware: the replica with the prefix
        messages = [{"role": "user", "content": "Name a colour."}]
        whole = gateway.chat.completions.create(messages=messages, **kwargs)
        assert whole.choices[0].message.content == direct.chat.completions.create(
            messages=messages, **kwargs).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in gateway.chat.completions.create(
            messages=messages, stream=True, **kwargs) if c.choices)
        assert streamed == whole.choices[0].message.content
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    assert codes[:2] == [0, 0], codes  # the replicas stop cleanly
