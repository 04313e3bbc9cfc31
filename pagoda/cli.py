"""The `pagoda` command line: one subcommand per job.

``serve`` runs the whole stack locally; ``scheduler``, ``worker`` and ``frontend``
run one role alone (what each container of compose.yaml runs); ``fetch``,
``generate`` and ``chat`` are offline conveniences.
"""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags, and every engine setting as the roles take it (shared/config.py)."""
    from shared.config import add_arguments

    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    add_arguments(p, groups=("engine",))


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="LLM inference-serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    for role, text in (("serve", "run the whole stack locally (pagoda serve --help)"),
                       ("scheduler", "run the scheduler alone"), ("worker", "run one worker rank"),
                       ("frontend", "run one tokenizer frontend"),
                       ("bench", "benchmark throughput and latency (pagoda bench --help)")):
        sub.add_parser(role, help=text, add_help=False)
    fetch = sub.add_parser("fetch", help="fetch a model alias into the cache, print its directory")
    fetch.add_argument("name", nargs="?", default="smollm2")
    fetch.add_argument("--cache-dir", default=None)
    health = sub.add_parser("health", help="exit 0 if a tcp:// endpoint accepts connections")
    health.add_argument("address", help="tcp://host:port")
    health.add_argument("--timeout", type=float, default=3.0)
    keys = sub.add_parser("keys", help="write CURVE keys for the ZMQ plane (--curve-keys DIR)")
    keys.add_argument("directory")
    gen = sub.add_parser("generate", help="generate completions for prompts, offline")
    gen.add_argument("prompts", nargs="+")
    _add_engine_args(gen)
    chat = sub.add_parser("chat", help="one chat turn through the model's chat template")
    chat.add_argument("message")
    chat.add_argument("--system", default=None)
    _add_engine_args(chat)
    return parser


def _engine_and_params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from dataclasses import asdict

    from pagoda.llm import LLM, SamplingParams
    from shared.config import load_engine_settings

    llm = LLM(**asdict(load_engine_settings(args)))  # flag > PAGODA_* env > default
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )
    return llm, params


def _generate(args: argparse.Namespace) -> int:
    llm, params = _engine_and_params(args)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        print(f"{out.prompt}{out.outputs[0].text}")
        print(f"[{len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason}]")
    return 0


def _chat(args: argparse.Namespace) -> int:
    llm, params = _engine_and_params(args)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}
    ]
    print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
    return 0


def _health(address: str, timeout: float) -> int:
    """A container health probe: ``http(s)://...`` must answer GET with 200 (the HTTP
    API's truthful /health); ``tcp://host:port`` must accept a connection."""
    import socket

    if address.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no env proxies
        try:
            with opener.open(address, timeout=timeout) as response:
                status = response.status
        except urllib.error.HTTPError as e:  # 503: draining or the engine unreachable
            print(f"pagoda health: {address}: {e.code} {e.read()[:200]!r}", file=sys.stderr)
            return 1
        except (OSError, ValueError) as e:
            print(f"pagoda health: {address}: {e}", file=sys.stderr)
            return 1
        return 0 if status == 200 else 1
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout).close()
    except (OSError, ValueError) as e:
        print(f"pagoda health: {address}: {e}", file=sys.stderr)
        return 1
    return 0


def _keys(directory: str) -> int:
    from shared.curve import AUTHORIZED_DIR, CurveError, generate_keys

    try:
        root = generate_keys(directory)
    except (CurveError, OSError) as e:
        print(f"pagoda keys: {e}", file=sys.stderr)
        return 1
    print(f"CURVE keys in {root}: server.key_secret for the binding roles (scheduler, "
          f"frontends), client.key_secret for the connecting ones (workers, frontends, "
          f"clients), {AUTHORIZED_DIR}/ the client keys a server lets in")
    return 0


def _resolve_role_model(argv: list[str]) -> list[str]:
    """``argv`` for a role that loads the model, with ``--model`` set to the local directory
    of the model it names (flag > PAGODA_MODEL > default; an alias is fetched once into
    the cache) and ``--served-model-name`` to the name as given, unless set: the services
    take only a directory and never import pagoda (pagoda.model_fetch)."""
    if "-h" in argv or "--help" in argv:
        return argv
    from pagoda.model_fetch import resolve_model, served_model_names
    from shared.config import resolve_setting

    pre = argparse.ArgumentParser(add_help=False)
    for key in ("model", "served_model_name", "cache_dir"):
        pre.add_argument("--" + key.replace("_", "-"), dest=key, default=None)
    given, _ = pre.parse_known_args(argv)
    model = resolve_setting("model", given.model)
    served = resolve_setting("served_model_name", given.served_model_name)
    cache_dir = resolve_setting("cache_dir", given.cache_dir)
    model_dir = resolve_model(model, cache_dir, progress=False)
    served = served or served_model_names(model, model_dir, cache_dir)
    # appended last: argparse keeps the last value of a repeated flag
    return [*argv, "--model", str(model_dir), "--served-model-name", served]


# role subcommands hand their arguments to the role's own parser
_ROLES = {
    "serve": ("pagoda.launcher", "serve"),
    "scheduler": ("services.scheduler.main", "main"),
    "worker": ("services.worker.main", "main"),
    "frontend": ("services.tokenizer.main", "main"),
    "bench": ("pagoda.bench.cli", "main"),
}
# the roles that load the model (the scheduler loads its tokenizer, for structured output):
# `pagoda <role>` resolves it
_MODEL_ROLES = ("scheduler", "worker", "frontend")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _ROLES:
        import importlib

        role, role_argv = argv[0], argv[1:]
        if role in _MODEL_ROLES:
            from pagoda.model_fetch import ModelError
            from shared.config import ConfigError

            try:
                role_argv = _resolve_role_model(role_argv)
            except (ConfigError, ModelError) as e:  # a bad name or variable: 2; a failed fetch: 1
                print(f"pagoda {role}: {e}", file=sys.stderr)
                return 2 if isinstance(e, ValueError) else 1
        module, func = _ROLES[role]
        return int(getattr(importlib.import_module(module), func)(role_argv) or 0)
    args = _build_parser().parse_args(argv)
    if args.command == "fetch":
        from pagoda.model_fetch import fetch_main

        return fetch_main([args.name] + (["--cache-dir", args.cache_dir] if args.cache_dir else []))
    if args.command == "health":
        return _health(args.address, args.timeout)
    if args.command == "keys":
        return _keys(args.directory)
    from shared.sampling_params import SamplingParamsError

    try:
        return {"generate": _generate, "chat": _chat}[args.command](args)
    except (SamplingParamsError, ValueError) as exc:
        print(f"pagoda {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
