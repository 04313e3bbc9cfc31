"""compose.yaml must be true: start every service's command with its environment as
local processes and serve requests through them.

There is no Docker engine here, so the test does what compose would: it merges
compose.yaml with compose.cpu.yaml (this machine has no GPU), resolves service names
to 127.0.0.1, maps the model-cache volume to the local cache, and starts each
replica. Two replicas on one host cannot bind the same port, so replica k of a
service binds its port + k (the published port range in compose.yaml is exactly that).
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
import pytest
import yaml

from pagoda.client import Client
from pagoda.model_fetch import default_cache_dir
from shared.sampling_params import SamplingParams
from support.live_stack import REPO, expected_offline

pytestmark = pytest.mark.slow


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if value is None:  # !reset
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_services() -> dict[str, dict[str, Any]]:
    main = yaml.load((REPO / "compose.yaml").read_text(), Loader=_ComposeLoader)
    cpu = yaml.load((REPO / "compose.cpu.yaml").read_text(), Loader=_ComposeLoader)
    return _merge(main, cpu)["services"]


def test_compose_file_shape() -> None:
    services = load_services()
    assert set(services) == {"scheduler", "worker", "tokenizer"}
    assert services["tokenizer"]["deploy"]["replicas"] == 2
    main = yaml.load((REPO / "compose.yaml").read_text(), Loader=_ComposeLoader)
    assert main["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert main["networks"]["zmq"]["internal"] is True
    for name, svc in main["services"].items():
        assert svc.get("stop_grace_period"), name
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        if name != "tokenizer":
            assert not svc.get("ports"), f"{name} must publish nothing"
    assert "127.0.0.1:8000-8001:8000" in main["services"]["tokenizer"]["ports"]


def _local_env(env: dict[str, Any], services: list[str], replica: int) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        text = str(value)
        for svc in services:
            text = text.replace(f"tcp://{svc}:", "tcp://127.0.0.1:")
        if key == "PAGODA_FRONTEND_NATIVE" and replica:
            text = re.sub(r":(\d+)$", lambda m: f":{int(m.group(1)) + replica}", text)
        if key == "PAGODA_HTTP_PORT":
            text = str(int(text) + replica)
        out[key] = text
    out["PAGODA_CACHE"] = str(default_cache_dir())  # the model-cache volume
    return out


def _command(cmd: list[str]) -> list[str]:
    assert cmd[0] == "pagoda", cmd
    return [sys.executable, "-m", "pagoda.cli", *cmd[1:]]


def _wait_healthy(test: list[str], env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> None:
    assert test[0] == "CMD"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        probe = subprocess.run(_command(test[1:]), env=env, cwd=REPO, capture_output=True,
                               check=False)
        if probe.returncode == 0:
            return
        assert all(p.poll() is None for p in procs), "a service exited while starting"
        time.sleep(0.2)  # polling the health probe, as compose does
    raise AssertionError(f"{test} never passed")


def _health(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
    except httpx.TransportError:
        return 0


def _wait_for(predicate: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.2)  # polling another process's state


def test_compose_services_serve_requests_and_come_back_after_a_death(
        smollm2_dir: Path, tmp_path: Path) -> None:
    """Every service as compose starts it; then the restart policy's case: the scheduler
    dies, its worker follows within seconds (exit non-zero: a worker serves one
    scheduler's engine), the frontends stay and answer /health 503; compose's `restart:`
    starts the two again (here: the same commands), and the frontends serve the same
    tokens again without being restarted."""
    services = load_services()
    names = list(services)
    for name, svc in services.items():
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name
    procs: dict[str, subprocess.Popen[bytes]] = {}
    sched_probe: tuple[list[str], dict[str, str]] | None = None

    def start(name: str, replica: int, attempt: int = 0) -> None:
        nonlocal sched_probe
        svc = services[name]
        # fp32: the tokens are compared with the offline engine's exactly
        env = {**os.environ, **_local_env(svc["environment"], names, replica),
               "PAGODA_DTYPE": "float32"}
        # the child keeps its own copy of the log's descriptor
        with open(tmp_path / f"{name}-{replica}-{attempt}.log", "wb") as log:
            procs[f"{name}-{replica}"] = subprocess.Popen(
                _command(svc["command"]), env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        if "healthcheck" in svc:
            probe = [str(x) for x in svc["healthcheck"]["test"]]
            probe = [re.sub(r":(\d+)(/|$)",
                            lambda m, r=replica: f":{int(m.group(1)) + r}{m.group(2)}", x)
                     for x in probe]
            if name != "scheduler":  # the scheduler is healthy only once the worker is up
                _wait_healthy(probe, env, list(procs.values()))
            else:
                sched_probe = (probe, env)
        if name == "worker":
            assert sched_probe is not None
            _wait_healthy(*sched_probe, list(procs.values()))

    prompt = "The three primary colours are"
    expected = expected_offline(smollm2_dir, [prompt], [SamplingParams(temperature=0.0, max_tokens=12)])

    def check_serves() -> None:
        for port in (5580, 5581):
            with Client(f"tcp://127.0.0.1:{port}", timeout=300) as client:
                got = client.generate(prompt, temperature=0.0, max_tokens=12)
            assert got.outputs[0].token_ids == expected[0].outputs[0].token_ids
        for port in (8000, 8001):  # the published HTTP API of each replica
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
                "prompt": prompt, "temperature": 0.0, "max_tokens": 12})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected[0].outputs[0].text

    try:
        for name in ("scheduler", "worker", "tokenizer"):
            for replica in range(services[name].get("deploy", {}).get("replicas", 1)):
                start(name, replica)
        check_serves()
        procs["scheduler-0"].kill()
        assert procs["worker-0"].wait(timeout=30) != 0
        _wait_for(lambda: {_health(8000), _health(8001)} == {503}, "frontends report 503")
        start("scheduler", 0, attempt=1)
        start("worker", 0, attempt=1)
        _wait_for(lambda: {_health(8000), _health(8001)} == {200}, "frontends healthy again")
        check_serves()
    finally:
        live = [p for p in procs.values() if p.poll() is None]
        for p in reversed(live):
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in live]
    assert codes == [0] * len(live), [(p.args, c) for p, c in zip(live, codes)]
