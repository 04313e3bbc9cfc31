"""deploy/kubernetes/ must be true: what a cluster would only show at start-up, checked here.

There is no cluster, so the test reads every manifest (multi-document YAML), models the
labels and environment the LeaderWorkerSet controller gives its pods, and checks the
invariants of the deployment: every container runs a `pagoda` role with a command that
role's own parser accepts and settings that exist; the tensor-parallel shape agrees
everywhere and splits the model; every connect address meets a bound port; every role gets exactly the CURVE
key files shared/curve.py makes it read, from a read-only 0400 Secret volume and never
from the environment; no ZMQ port is reachable from outside the cluster or, inside it,
from pods of another app.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from pagoda.cli import _ROLES
from pagoda.model_fetch import ALIASES, resolve_model
from services.worker.model_config import ModelConfig
from services.worker.parallel import ShardingError, TensorParallel, shard_sizes
from shared.config import SETTINGS, SETTINGS_BY_KEY
from shared.curve import AUTHORIZED_DIR, CLIENT_SECRET, SERVER_PUBLIC, SERVER_SECRET

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
Obj = dict[str, Any]
Objects = dict[tuple[str, str], Obj]  # by (kind, name)

ROLES = ("scheduler", "worker", "frontend")
BINDING_ROLES = ("scheduler", "frontend")  # need the server pair and the allow-list
CONNECTING_ROLES = ("worker", "frontend")  # need the client pair
# scheduler 5570-5572 (frontends, steps, results), a frontend's native API, torch.distributed
ZMQ_PORTS = frozenset({5570, 5571, 5572, 5580, 29500})
HTTP_PORT = 8000
# the labels that make a pod one of this app's (NetworkPolicy peers)
APP_LABELS = frozenset({("app.kubernetes.io/name", "pagoda"),
                        ("app.kubernetes.io/part-of", "pagoda")})
LWS = "leaderworkerset.sigs.k8s.io/"
# a Z85 CURVE key is 40 characters of this alphabet; a certificate names its keys
Z85_KEY = re.compile(r"[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
CERTIFICATE = re.compile(r"(public|secret)-key\s*=")
VAR = re.compile(r"\$\((\w+)\)")


# -- reading the manifests -------------------------------------------------------------------


def load_objects() -> Objects:
    """Every object of every manifest under deploy/kubernetes/, by (kind, name)."""
    objects: Objects = {}
    files = sorted(MANIFESTS.rglob("*.yaml"))
    assert files, f"no manifests under {MANIFESTS}"
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{path.name}: {key} defined twice"
            objects[key] = doc
    return objects


@dataclass(frozen=True)
class Pod:
    """One pod template, with the labels its pods will carry."""

    name: str  # e.g. LeaderWorkerSet/pagoda-engine/leader
    labels: dict[str, str]
    spec: Obj
    # what a controller puts first in every container's environment (plausible values)
    injected_env: tuple[tuple[str, str], ...] = ()

    @property
    def is_lws_leader(self) -> bool:
        return self.labels.get(LWS + "worker-index") == "0"


@dataclass(frozen=True)
class Container:
    pod: Pod
    spec: Obj
    env: dict[str, str | None]  # envFrom ConfigMaps, then env; None: from the downward API

    @property
    def command(self) -> list[str]:
        return [str(x) for x in self.spec.get("command", [])]

    @property
    def role(self) -> str:
        return self.command[1]

    @property
    def where(self) -> str:
        return f"{self.pod.name}/{self.spec['name']}"

    def expand(self, text: str) -> str:
        """``text`` with $(VAR) replaced as the kubelet does, by the LWS variables' values."""
        injected = dict(self.pod.injected_env)

        def one(m: re.Match[str]) -> str:
            assert m.group(1) in injected, f"{self.where}: $({m.group(1)}) is never set"
            return injected[m.group(1)]

        return VAR.sub(one, text)

    def setting(self, key: str) -> str | None:
        """A setting's value as the role resolves it: its flag, else its variable."""
        s = SETTINGS_BY_KEY[key]
        for i, arg in enumerate(self.command):
            if arg == s.flag:
                return self.command[i + 1]
            if arg.startswith(s.flag + "="):
                return arg.split("=", 1)[1]
        return self.env.get(s.env)


def lws_pods(lws: Obj) -> Iterator[Pod]:
    """Group 0's leader pod and its first worker pod, with the labels and the environment
    the LeaderWorkerSet controller adds (sigs.k8s.io/lws pkg/utils/pod/pod_utils.go)."""
    name, template = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    kinds = [("leader", template.get("leaderTemplate") or template["workerTemplate"], "0")]
    if template["size"] > 1:
        kinds.append(("worker", template["workerTemplate"], "1"))
    for kind, pod, index in kinds:
        labels = {**pod["metadata"].get("labels", {}), LWS + "name": name,
                  LWS + "group-index": "0", LWS + "worker-index": index}
        env = (("LWS_LEADER_ADDRESS", "10.0.0.1"), ("LWS_GROUP_SIZE", str(template["size"])),
               ("LWS_WORKER_INDEX", index))
        yield Pod(f"LeaderWorkerSet/{name}/{kind}", labels, pod["spec"], env)


def pods(objects: Objects) -> list[Pod]:
    out: list[Pod] = []
    for (kind, name), obj in objects.items():
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            template = obj["spec"]["template"]
            out.append(Pod(f"{kind}/{name}", template["metadata"].get("labels", {}),
                           template["spec"]))
        elif kind == "LeaderWorkerSet":
            out.extend(lws_pods(obj))
        elif kind == "Pod":
            out.append(Pod(f"Pod/{name}", obj["metadata"].get("labels", {}), obj["spec"]))
    return out


def container_env(spec: Obj, objects: Objects) -> dict[str, str | None]:
    env: dict[str, str | None] = {}
    for source in spec.get("envFrom", []):
        # a Secret's keys as variables would put whatever it holds in the environment
        assert set(source) == {"configMapRef"}, f"{spec['name']}: envFrom only from ConfigMaps"
        env.update(objects["ConfigMap", source["configMapRef"]["name"]]["data"])
    for var in spec.get("env", []):
        env[var["name"]] = None if "valueFrom" in var else str(var["value"])
    return env


def containers(objects: Objects) -> list[Container]:
    return [Container(pod, c, container_env(c, objects))
            for pod in pods(objects) for c in pod.spec["containers"]]


def by_role(objects: Objects, role: str) -> list[Container]:
    found = [c for c in containers(objects) if c.role == role]
    assert found, f"no {role} container"
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def tcp_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host, int(port)


@pytest.fixture(scope="module")
def objects() -> Objects:
    return load_objects()


# -- what runs -------------------------------------------------------------------------------


def test_the_manifests_hold_the_deployment(objects: Objects) -> None:
    for key in [("Deployment", "pagoda-frontend"), ("Service", "pagoda-frontend"),
                ("LeaderWorkerSet", "pagoda-engine"), ("Service", "pagoda-scheduler"),
                ("ConfigMap", "pagoda-config"), ("Secret", "pagoda-curve-server"),
                ("Secret", "pagoda-curve-client")]:
        assert key in objects, f"{key} missing"
    lws = objects["LeaderWorkerSet", "pagoda-engine"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert any(kind == "NetworkPolicy" for kind, _ in objects)


def test_every_container_runs_a_pagoda_role(objects: Objects) -> None:
    for c in containers(objects):
        assert c.command[:1] == ["pagoda"], f"{c.where}: {c.command}"
        assert c.role in ROLES, f"{c.where}: role {c.role!r}"
        assert "args" not in c.spec, f"{c.where}: the whole command in `command`"


def test_the_tensor_parallel_shape_agrees(objects: Objects) -> None:
    """LWS size = --nnodes; one --tensor-parallel-size for the scheduler and every worker;
    each pod's GPUs are its ranks (M / K); node ranks 0 (leader) and LWS_WORKER_INDEX."""
    lws = objects["LeaderWorkerSet", "pagoda-engine"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    workers = by_role(objects, "worker")
    tp_sizes = {str(c.setting("tensor_parallel_size"))
                for c in workers + by_role(objects, "scheduler")}
    assert len(tp_sizes) == 1 and tp_sizes != {"None"}, f"tensor-parallel sizes {tp_sizes}"
    tp = int(tp_sizes.pop())
    assert tp % size == 0, f"--tensor-parallel-size {tp} is not a multiple of {size} nodes"
    assert {c.pod.name for c in workers} == {p.name for p in lws_pods(lws)}, "a worker per pod"
    for c in workers:
        cmd = c.command
        assert cmd[cmd.index("--nnodes") + 1] == str(size), f"{c.where}: --nnodes != LWS size"
        rank = cmd[cmd.index("--node-rank") + 1]
        assert rank == ("0" if c.pod.is_lws_leader else "$(LWS_WORKER_INDEX)"), c.where
        assert cmd[cmd.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)", c.where
        assert int(cmd[cmd.index("--master-port") + 1]) in ZMQ_PORTS, f"{c.where}: master port"
        resources = c.spec["resources"]
        for part in ("requests", "limits"):
            assert int(resources[part]["nvidia.com/gpu"]) == tp // size, f"{c.where}: {part}"


def test_the_model_splits_over_the_tensor_parallel_size(objects: Objects) -> None:
    """The ranks refuse a model they cannot split (services/worker/parallel.py
    shard_sizes): --tensor-parallel-size must divide its attention heads and intermediate
    size, and divide its KV heads or be a multiple of them. The ConfigMap's model, an
    alias, is fetched into the local cache as `pagoda <role>` fetches it into /cache."""
    (scheduler,) = by_role(objects, "scheduler")
    tp = int(str(scheduler.setting("tensor_parallel_size")))
    model = str(scheduler.setting("model"))
    if model not in ALIASES:
        pytest.skip(f"PAGODA_MODEL {model!r} is not an alias: its config is not here")
    cfg = ModelConfig.from_dir(resolve_model(model, progress=False))
    try:
        shard_sizes(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                    cfg.vocab_size, TensorParallel(0, tp))
    except ShardingError as e:
        pytest.fail(f"{model}: {e}")


def test_every_connect_address_meets_a_bound_port(objects: Objects) -> None:
    """Frontends reach the scheduler through a ClusterIP Service that selects the leader
    pod only; workers reach it at LWS_LEADER_ADDRESS on the ports it binds."""
    (scheduler,) = by_role(objects, "scheduler")
    bound = {key: tcp_host_port(str(scheduler.setting(key)))
             for key in ("scheduler_frontend", "scheduler_step", "scheduler_result")}
    assert all(host == "0.0.0.0" for host, _ in bound.values()), bound
    declared = {p["containerPort"] for p in scheduler.spec["ports"]}
    assert {port for _, port in bound.values()} <= declared
    for c in by_role(objects, "frontend"):
        host, port = tcp_host_port(str(c.setting("scheduler_frontend")))
        service = objects["Service", host]
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
        (entry,) = [p for p in service["spec"]["ports"] if p["port"] == port]
        assert entry.get("targetPort", port) == bound["scheduler_frontend"][1]
        selected = [p.name for p in pods(objects) if selects(service["spec"]["selector"], p.labels)]
        assert selected == [scheduler.pod.name], f"Service {host} selects {selected}"
    for c in by_role(objects, "worker"):
        for key in ("scheduler_step", "scheduler_result"):
            assert c.setting(key) == f"tcp://$(LWS_LEADER_ADDRESS):{bound[key][1]}", c.where


# -- the CLI accepts every command and setting -----------------------------------------------


class CommandRejected(Exception):
    """A role's parser refused a command line (argparse's error, raised instead of exiting)."""


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


def parse_role_command(c: Container, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The container's command parsed by the parser its role builds (the role's own main,
    as `pagoda <role>` dispatches it), stopped right after parsing: no config is loaded, no
    model read, no socket opened. $(VAR)s are expanded first, as the kubelet does."""
    module, func = _ROLES[c.role]
    main = getattr(importlib.import_module(module), func)
    # `pagoda <role>` appends the resolved model directory and its served name
    argv = [*(c.expand(a) for a in c.command[2:]), "--model", "/cache/model",
            "--served-model-name", "model"]
    real_parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, args: Any = None,
                       namespace: Any = None) -> NoReturn:
        raise _Parsed(real_parse_args(self, args, namespace))

    def reject(self: argparse.ArgumentParser, message: str) -> NoReturn:
        raise CommandRejected(f"{c.where}: {self.prog}: {message}")

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        m.setattr(argparse.ArgumentParser, "error", reject)
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.namespace
    raise AssertionError(f"{c.where}: {module}.{func} returned without parsing its arguments")


def test_scheduler_and_frontend_commands_parse(objects: Objects,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for c in by_role(objects, "scheduler") + by_role(objects, "frontend"):
        parse_role_command(c, monkeypatch)


def test_worker_commands_parse(objects: Objects,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    for c in by_role(objects, "worker"):
        args = parse_role_command(c, monkeypatch)
        assert args.tensor_parallel_size == int(str(c.setting("tensor_parallel_size"))), c.where


def test_env_names_are_settings_and_values_parse(objects: Objects) -> None:
    """Every PAGODA_* name is a setting's variable (a typo would be ignored silently), and
    every literal value parses as that setting (shared/config.py SETTINGS)."""
    by_env = {s.env: s for s in SETTINGS}
    for c in containers(objects):
        for name, value in c.env.items():
            if not name.startswith("PAGODA_"):
                continue
            assert name in by_env, f"{c.where}: {name} is not a setting's variable"
            if value is not None:
                try:
                    by_env[name].parse(c.expand(value))
                except ValueError as e:
                    pytest.fail(f"{c.where}: {name}={value!r}: {e}")
    for (kind, name), obj in objects.items():
        if kind == "ConfigMap":
            unknown = [k for k in obj["data"] if k.startswith("PAGODA_") and k not in by_env]
            assert not unknown, f"ConfigMap {name}: {unknown} are not settings' variables"


# -- probes ----------------------------------------------------------------------------------


def test_frontends_probe_health(objects: Objects) -> None:
    """Readiness, and liveness or start-up (model load takes minutes), all on /health."""
    for c in by_role(objects, "frontend"):
        port = int(str(c.setting("http_port")))
        kinds = [k for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c.spec]
        assert "readinessProbe" in kinds and len(kinds) >= 2, f"{c.where}: probes {kinds}"
        for kind in kinds:
            probe = c.spec[kind]["httpGet"]
            assert probe == {"path": "/health", "port": port}, f"{c.where}: {kind}"


def test_the_scheduler_has_a_probe_on_its_port(objects: Objects) -> None:
    for c in by_role(objects, "scheduler"):
        _, port = tcp_host_port(str(c.setting("scheduler_frontend")))
        assert "readinessProbe" in c.spec and "livenessProbe" in c.spec, c.where
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind in c.spec:
                assert c.spec[kind]["exec"]["command"] == [
                    "pagoda", "health", f"tcp://127.0.0.1:{port}"], f"{c.where}: {kind}"


# -- CURVE keys ------------------------------------------------------------------------------


def secret_keys(secret: Obj) -> set[str]:
    return set(secret.get("data") or {}) | set(secret.get("stringData") or {})


def curve_files(c: Container, objects: Objects) -> set[str]:
    """The files of the container's CURVE keys directory, relative to it; checks that the
    directory is a read-only mount of Secrets only, every file mode 0400."""
    directory = c.setting("curve_keys")
    assert directory, f"{c.where}: no --curve-keys / PAGODA_CURVE_KEYS"
    (mount,) = [m for m in c.spec.get("volumeMounts", [])
                if m["mountPath"].rstrip("/") == directory.rstrip("/")]
    assert mount.get("readOnly") is True and "subPath" not in mount, f"{c.where}: {mount}"
    (volume,) = [v for v in c.pod.spec["volumes"] if v["name"] == mount["name"]]
    if "secret" in volume:
        sources = [(volume["secret"]["secretName"], volume["secret"])]
        mode = volume["secret"].get("defaultMode")
    else:
        projected = volume["projected"]
        assert all(set(s) == {"secret"} for s in projected["sources"]), f"{c.where}: not Secrets"
        sources = [(s["secret"]["name"], s["secret"]) for s in projected["sources"]]
        mode = projected.get("defaultMode")
    assert mode == 0o400, f"{c.where}: defaultMode {mode!r}, want 0400 (owner read only)"
    files: set[str] = set()
    for name, source in sources:
        keys = secret_keys(objects["Secret", name])
        items = source.get("items")
        for item in items or []:
            assert item["key"] in keys, f"{c.where}: Secret {name} has no key {item['key']}"
            assert item.get("mode", 0o400) == 0o400, f"{c.where}: {item}"
        paths = [item["path"] for item in items] if items else sorted(keys)
        assert not files & set(paths), f"{c.where}: {files & set(paths)} projected twice"
        files.update(paths)
    return files


def test_every_role_gets_its_curve_keys_from_a_secret(objects: Objects) -> None:
    """What shared/curve.py reads per role, and no secret key a role does not use."""
    for c in containers(objects):
        files = curve_files(c, objects)
        binds, connects = c.role in BINDING_ROLES, c.role in CONNECTING_ROLES
        assert SERVER_PUBLIC in files, f"{c.where}: {SERVER_PUBLIC}"
        assert (SERVER_SECRET in files) == binds, f"{c.where}: {SERVER_SECRET} {sorted(files)}"
        allowed = [f for f in files if re.fullmatch(rf"{AUTHORIZED_DIR}/[^/]+\.key", f)]
        assert bool(allowed) == binds, f"{c.where}: allow-list {sorted(files)}"
        assert (CLIENT_SECRET in files) == connects, f"{c.where}: {CLIENT_SECRET} {sorted(files)}"


def test_secret_files_stay_readable_by_their_owner_alone(objects: Objects) -> None:
    """The image runs as root, the owner of a Secret volume's files. An fsGroup would make
    them group-readable (shared/curve.py refuses that); another user could not read them."""
    for pod in pods(objects):
        contexts = [pod.spec.get("securityContext") or {}]
        contexts += [c.get("securityContext") or {} for c in pod.spec["containers"]]
        assert "fsGroup" not in contexts[0], f"{pod.name}: fsGroup"
        assert all(ctx.get("runAsUser", 0) == 0 for ctx in contexts), f"{pod.name}: runAsUser"


def test_no_key_material_in_the_environment(objects: Objects) -> None:
    curve_secrets = {name for (kind, name), obj in objects.items()
                     if kind == "Secret" and secret_keys(obj) & {SERVER_PUBLIC, SERVER_SECRET,
                                                                 CLIENT_SECRET}}
    for pod in pods(objects):
        for spec in pod.spec["containers"]:
            for var in spec.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                assert not ref or ref["name"] not in curve_secrets, f"{pod.name}: {var['name']}"
                value = str(var.get("value", ""))
                assert not Z85_KEY.fullmatch(value) and not CERTIFICATE.search(value), var["name"]
    for (kind, name), obj in objects.items():
        if kind == "ConfigMap":
            for key, value in obj["data"].items():
                assert not Z85_KEY.fullmatch(value) and not CERTIFICATE.search(value), key
        if kind == "Secret":  # the committed Secrets are templates: placeholders only
            values = {**(obj.get("data") or {}), **(obj.get("stringData") or {})}
            assert not any(CERTIFICATE.search(str(v)) for v in values.values()), name


def test_wildcard_bind_is_never_allowed(objects: Objects) -> None:
    """CURVE, not PAGODA_ALLOW_WILDCARD_BIND, is what lets the roles bind 0.0.0.0."""
    setting = SETTINGS_BY_KEY["allow_wildcard_bind"]
    for c in containers(objects):
        assert setting.env not in c.env, c.where
        assert not any(setting.flag in a for a in c.command), c.where


# -- the network -----------------------------------------------------------------------------


def test_no_zmq_port_leaves_the_cluster(objects: Objects) -> None:
    for (kind, name), obj in objects.items():
        if kind == "Service" and obj["spec"].get("type", "ClusterIP") != "ClusterIP":
            exposed = {p["port"] for p in obj["spec"]["ports"]}
            exposed |= {p.get("targetPort", p["port"]) for p in obj["spec"]["ports"]}
            assert not exposed & ZMQ_PORTS, f"Service {name} exposes {exposed & ZMQ_PORTS}"
        if kind == "Ingress":
            backends = [obj["spec"].get("defaultBackend") or {}]
            backends += [path["backend"] for rule in obj["spec"].get("rules", [])
                         for path in rule.get("http", {}).get("paths", [])]
            ports = {b.get("service", {}).get("port", {}).get("number") for b in backends}
            assert not ports & ZMQ_PORTS, f"Ingress {name} routes to {ports & ZMQ_PORTS}"
    for pod in pods(objects):
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.spec.get(flag), f"{pod.name}: {flag}"
        for spec in pod.spec["containers"]:
            for port in spec.get("ports", []):
                assert "hostPort" not in port, f"{pod.name}: hostPort {port}"


def _rule_allows(rule: Obj, port: int) -> bool:
    entries = rule.get("ports")
    if not entries:  # no ports: every port
        return True
    for entry in entries:
        assert isinstance(entry.get("port"), int), f"numeric ports only: {entry}"
        if entry["port"] <= port <= entry.get("endPort", entry["port"]):
            return True
    return False


def _app_pods_only(rule: Obj) -> bool:
    """True when every peer of the rule is a pod of this app in the same namespace."""
    peers = rule.get("from")
    if not peers:  # no peers: from everywhere
        return False
    return all(set(p) == {"podSelector"}
               and APP_LABELS & set((p["podSelector"].get("matchLabels") or {}).items())
               for p in peers)


def test_network_policy_admits_zmq_only_from_this_app(objects: Objects) -> None:
    """Every pod is isolated by a policy; each ZMQ port a container listens on is let in
    from this app's pods, and by no rule from anyone else; HTTP is let in."""
    policies = [obj["spec"] for (kind, _), obj in objects.items() if kind == "NetworkPolicy"]
    listening: set[int] = set()
    for pod in pods(objects):
        rules = [rule for spec in policies
                 if selects(spec["podSelector"].get("matchLabels") or {}, pod.labels)
                 and "Ingress" in spec.get("policyTypes", ["Ingress"])
                 for rule in spec.get("ingress", [])]
        assert rules, f"{pod.name}: no NetworkPolicy selects it"
        ports = {p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])}
        listening |= ports
        for port in ports & ZMQ_PORTS:
            allowing = [rule for rule in rules if _rule_allows(rule, port)]
            assert allowing, f"{pod.name}: nothing may reach ZMQ port {port}"
            assert all(_app_pods_only(rule) for rule in allowing), f"{pod.name}: {port} open"
        if HTTP_PORT in ports:
            assert any(_rule_allows(rule, HTTP_PORT) for rule in rules), f"{pod.name}: HTTP"
    assert listening >= ZMQ_PORTS | {HTTP_PORT}, f"ports no container declares: " \
        f"{sorted(ZMQ_PORTS - listening)}"
