"""deploy/kubernetes/ must start: run every container the manifests name as a local
process, wait for it as its probes say, and serve requests through it.

There is no cluster, so the test does what the kubelet and the LeaderWorkerSet
controller would, on one host: for the leader pod (its `scheduler` and `worker`
containers), each worker pod (LWS_WORKER_INDEX 1 .. size-1) and one frontend replica, it
takes the container's `command` and its environment as the kubelet builds it: the
controller's LWS_* variables first, then the ConfigMap, then `env`, $(VAR) expanded, the
pod IP from the downward API.
Every host is 127.0.0.1 (the leader address, the pod IP, each Service's DNS name).

Only what cannot be the same on one host is replaced:

- the CURVE keys directory: fresh keys from shared.curve.generate_keys, projected per
  container exactly as its Secret volume projects them (only the files it mounts, 0400)
  into a directory of its own, instead of /etc/pagoda/curve;
- the model cache (the `cache` volume): the local cache, pagoda.model_fetch.default_cache_dir();
- ports: HTTP 8000 becomes a free port, and a ZMQ or torch.distributed port (5570-5572,
  5580, 29500) that something here already listens on becomes a free one, in every
  command, variable and probe alike;
- a KV pool size (PAGODA_NUM_KV_BLOCKS=256): the manifests set none, so each rank would
  take the CPU default (2 GiB), times three ranks on this one host.

plus float32 (tokens are compared with the offline engine's exactly) and PAGODA_TESTING=1.
Each node's `pagoda worker` starts its rank as a child process (node mode), as in a pod.

One frontend replica, not the Deployment's two: the test machine may have 2 cores, which
the three SmolLM2 ranks, the scheduler and the frontend already share, and a second
replica would be the same command and environment, only another port.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_kubernetes import load_objects

from pagoda.client import Client
from pagoda.model_fetch import default_cache_dir
from shared.curve import (
    AUTHORIZED_DIR,
    CLIENT_PUBLIC,
    CLIENT_SECRET,
    SERVER_PUBLIC,
    SERVER_SECRET,
    generate_keys,
)
from shared.sampling_params import SamplingParams
from support.live_stack import REPO, free_port

pytestmark = pytest.mark.slow

Obj = dict[str, Any]
HOST = "127.0.0.1"  # every pod, every Service, the leader
HTTP_PORT = 8000
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
PROMPT = "The three primary colours are"
MAX_TOKENS = 12
VAR = re.compile(r"\$\((\w+)\)")
# What each Secret holds, as README.md's `kubectl create secret` makes them from the
# directory `pagoda keys` writes: Secret key -> file of that directory.
SECRET_FILES = {
    "pagoda-curve-server": {SERVER_PUBLIC: SERVER_PUBLIC, SERVER_SECRET: SERVER_SECRET,
                            CLIENT_PUBLIC: f"{AUTHORIZED_DIR}/{CLIENT_PUBLIC}"},
    "pagoda-curve-client": {SERVER_PUBLIC: SERVER_PUBLIC, CLIENT_SECRET: CLIENT_SECRET},
}


@dataclass
class Running:
    """One container started as a local process."""

    name: str  # pod/container
    spec: Obj
    env: dict[str, str]
    local: Callable[[str], str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} ({self.log}):\n{self.log.read_text(errors='replace')[-chars:]}"


def pagoda(cmd: list[str]) -> list[str]:
    assert cmd[0] == "pagoda", cmd
    return [sys.executable, "-m", "pagoda.cli", *cmd[1:]]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def pod_templates(objects: dict[tuple[str, str], Obj]) -> list[tuple[str, Obj, dict[str, str]]]:
    """(pod name, pod spec, what the controller injects) for the leader pod, every worker
    pod of group 0 and one frontend replica, in the order their controllers create them."""
    lws = objects["LeaderWorkerSet", "pagoda-engine"]
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # all pods start at once
    template = lws["spec"]["leaderWorkerTemplate"]
    size = int(template["size"])
    out = []
    for index in range(size):
        pod = template["leaderTemplate"] if index == 0 else template["workerTemplate"]
        injected = {"LWS_LEADER_ADDRESS": HOST, "LWS_GROUP_SIZE": str(size),
                    "LWS_WORKER_INDEX": str(index)}
        out.append((f"engine-{index}", pod["spec"], injected))
    frontend = objects["Deployment", "pagoda-frontend"]["spec"]["template"]["spec"]
    out.append(("frontend-0", frontend, {}))
    return out


def expand(text: str, env: dict[str, str], where: str) -> str:
    """$(VAR) as the kubelet expands it: a variable defined before this one."""
    def one(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"{where}: $({m.group(1)}) is not set before it is used"
        return env[m.group(1)]

    return VAR.sub(one, text)


def kubelet_env(spec: Obj, injected: dict[str, str], objects: dict[tuple[str, str], Obj],
                where: str) -> dict[str, str]:
    env = dict(injected)
    for source in spec.get("envFrom", []):
        env.update(objects["ConfigMap", source["configMapRef"]["name"]]["data"])
    for var in spec.get("env", []):
        if "valueFrom" in var:
            path = var["valueFrom"].get("fieldRef", {}).get("fieldPath")
            assert path == "status.podIP", f"{where}: {var} (teach the test this source)"
            env[var["name"]] = HOST
        else:
            env[var["name"]] = expand(str(var["value"]), env, where)
    return env


def mounted_volume(spec: Obj, pod: Obj, path: str, where: str) -> Obj:
    """The volume mounted at ``path`` in this container."""
    mounts = [m for m in spec.get("volumeMounts", []) if m["mountPath"].rstrip("/") == path]
    assert len(mounts) == 1, f"{where}: {path} is not one volume's mount"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
    return volume


def project_keys(volume: Obj, keys: Path, into: Path) -> Path:
    """The files a Secret volume (or a projected one of Secrets) puts in the container,
    made from the generated keys, 0400 as its defaultMode says."""
    if "secret" in volume:
        sources, mode = [volume["secret"] | {"name": volume["secret"]["secretName"]}], \
            volume["secret"]["defaultMode"]
    else:
        sources = [s["secret"] for s in volume["projected"]["sources"]]
        mode = volume["projected"]["defaultMode"]
    into.mkdir(mode=0o700, parents=True)
    for source in sources:
        files = SECRET_FILES[source["name"]]
        items = source.get("items") or [{"key": k, "path": k} for k in files]
        for item in items:
            target = into / item["path"]
            target.parent.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(keys / files[item["key"]], target)
            target.chmod(item.get("mode", mode))
    return into


def http_status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return 0


def probe_passes(c: Running) -> bool:
    """The container's readiness probe, as the kubelet runs it (exec, or httpGet on the
    pod IP: a status of 200-399)."""
    probe = c.spec["readinessProbe"]
    if "exec" in probe:
        cmd = [c.local(str(x)) for x in probe["exec"]["command"]]
        return subprocess.run(pagoda(cmd), env=c.env, cwd=REPO, capture_output=True,
                              check=False, timeout=60).returncode == 0
    get = probe["httpGet"]
    port = int(c.local(str(get["port"])))
    return 200 <= http_status(f"http://{HOST}:{port}{get['path']}") < 400


def offline_expected(model_dir: Path) -> tuple[list[int], str]:
    from pagoda import LLM

    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=256)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                          use_tqdm=False)
    del llm
    gc.collect()
    return list(out.outputs[0].token_ids), out.outputs[0].text


def test_the_manifests_start_and_serve(smollm2_dir: Path, tmp_path: Path) -> None:
    """Every container of the manifests starts from its own command and environment; the
    scheduler's and the frontend's probes pass; the frontend serves the offline engine's
    greedy tokens over HTTP and to a native client over CURVE; every process exits 0 on
    SIGTERM."""
    objects = load_objects()
    expected_ids, expected_text = offline_expected(smollm2_dir)
    keys = generate_keys(tmp_path / "curve")

    # the ports any container declares; HTTP always moves, the others only when taken here
    declared = {int(p["containerPort"]) for _, pod, _ in pod_templates(objects)
                for c in pod["containers"] for p in c.get("ports", [])}
    assert HTTP_PORT in declared, declared
    ports = {port: port if port != HTTP_PORT and port_is_free(port) else free_port()
             for port in declared}
    services = [name for kind, name in objects if kind == "Service"]

    def local(text: str) -> str:
        for name in services:  # each Service's DNS name: this host
            text = text.replace(f"//{name}:", f"//{HOST}:")
        return re.sub(r"\b\d{4,5}\b", lambda m: str(ports.get(int(m.group()), m.group())), text)

    containers: list[Running] = []
    for pod_name, pod, injected in pod_templates(objects):
        for spec in pod["containers"]:
            where = f"{pod_name}/{spec['name']}"
            env = {k: local(v) for k, v in kubelet_env(spec, injected, objects, where).items()}
            # one host: the keys of this container's Secret volume, the local model cache
            volume = mounted_volume(spec, pod, env["PAGODA_CURVE_KEYS"], where)
            env["PAGODA_CURVE_KEYS"] = str(project_keys(volume, keys, tmp_path / where))
            assert "emptyDir" in mounted_volume(spec, pod, env["PAGODA_CACHE"], where)
            env["PAGODA_CACHE"] = str(default_cache_dir())
            # the manifests leave the KV pool at the worker's default; three ranks share
            # this host, so each gets a small one (a one-host substitution)
            assert not {"PAGODA_NUM_KV_BLOCKS", "PAGODA_KV_CACHE_BYTES"} & set(env), where
            env["PAGODA_NUM_KV_BLOCKS"] = "256"
            env.update(PAGODA_DTYPE="float32", PAGODA_TESTING="1", PYTHONUNBUFFERED="1")
            containers.append(Running(where, spec, env, local,
                                      tmp_path / f"{where.replace('/', '-')}.log"))
    roles = [c.spec["command"][1] for c in containers]
    size = objects["LeaderWorkerSet", "pagoda-engine"]["spec"]["leaderWorkerTemplate"]["size"]
    assert roles == ["scheduler", *["worker"] * size, "frontend"], roles

    def started() -> list[Running]:
        return [c for c in containers if c.proc is not None]

    def exited() -> str:
        return "\n".join(f"{c.name} exited {code}\n{c.tail()}" for c in started()
                         if (code := c.proc.poll() if c.proc else None) is not None)

    try:
        for c in containers:
            command = pagoda([expand(c.local(str(x)), c.env, c.name)
                              for x in c.spec["command"]])
            with open(c.log, "wb") as log:  # the child keeps its own copy of the descriptor
                c.proc = subprocess.Popen(command, env={**os.environ, **c.env}, cwd=REPO,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        probed = [c for c in containers if "readinessProbe" in c.spec]
        assert {c.spec["command"][1] for c in probed} == {"scheduler", "frontend"}
        started_at = time.monotonic()
        deadline = started_at + READY_TIMEOUT_S
        while not all(c.ready for c in probed):
            problem = exited()
            assert not problem, f"a container exited while starting:\n{problem}"
            assert time.monotonic() < deadline, "not ready within " \
                f"{READY_TIMEOUT_S:.0f}s:\n" + "\n".join(c.tail() for c in containers)
            for c in probed:
                c.ready = c.ready or probe_passes(c)
            time.sleep(1.0)  # polling the probes, as the kubelet does
        print(f"ready after {time.monotonic() - started_at:.0f}s")

        (frontend,) = [c for c in containers if c.spec["command"][1] == "frontend"]
        http = f"http://{HOST}:{frontend.env['PAGODA_HTTP_PORT']}"
        models = httpx.get(f"{http}/v1/models", timeout=30)
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        answer = httpx.post(f"{http}/v1/completions", timeout=300, json={
            "model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected_text
        native = frontend.env["PAGODA_FRONTEND_NATIVE"].replace("0.0.0.0", HOST)
        with Client(native, timeout=300, curve_keys=keys) as client:
            got = client.generate(PROMPT, temperature=0.0, max_tokens=MAX_TOKENS)
        assert list(got.outputs[0].token_ids) == expected_ids
        assert got.outputs[0].text == expected_text

        # what the kubelet does to every pod of a deleted group: SIGTERM to the command
        running = [c for c in reversed(containers) if c.proc is not None]
        for c in running:
            assert c.proc is not None and c.proc.poll() is None, exited()
            c.proc.send_signal(signal.SIGTERM)
        codes = {}
        for c in running:
            assert c.proc is not None
            try:
                codes[c.name] = c.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                codes[c.name] = None
        assert all(code == 0 for code in codes.values()), \
            f"exit codes {codes}\n" + "\n".join(c.tail() for c in running)
    finally:
        for c in started():
            assert c.proc is not None
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
            # a node's ranks are its children, in its process group
            try:
                os.killpg(c.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
