"""The frontend process: tokenizer, detokenizer and client APIs in front of the scheduler.

    python -m services.tokenizer.main [--frontend-index I] [flags / PAGODA_* env,
                                      see shared/config.py]

Any number of these run side by side; each binds its own native-API ROUTER at
``frontend_native[I]`` and connects one DEALER to the scheduler, identified as
``frontend-<I>-<host>-<pid>`` (the host keeps compose replicas, which share an index
and may share a pid, apart). Start-up: load the tokenizer and the model's limits from
the model directory, bind, report ready (a line on stdout, and through ``--ready-fd``
for a parent). One asyncio loop (uvloop) runs every API of the process (the native ZMQ
API and the OpenAI-compatible HTTP API) over one ``FrontendCore`` (``frontend_core.py``:
the tokenizer and the engine client). ``--model`` is a model directory: ``pagoda
frontend`` and ``pagoda serve`` resolve names such as ``smollm2`` before starting it.

SIGTERM/SIGINT: stop accepting (new requests get ``overloaded``), let in-flight ones
finish for up to ``--shutdown-timeout-s``, abort the rest at the scheduler (clients get
finish_reason "abort"), close the sockets (removing ipc files) and exit 0. A second
signal skips the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from services.tokenizer.engine_client import EngineClient
from services.tokenizer.engine_stats import EngineStatsView
from services.tokenizer.frontend_core import FrontendCore
from services.tokenizer.http_api import HttpApi
from services.tokenizer.input_processor import InputProcessor, load_limits, load_tokenizer
from services.tokenizer.native_api import NativeApi
from services.tokenizer.tool_calls import ToolCalling
from shared.codec import MalformedFrameCounter
from shared.config import ConfigError, PagodaConfig, add_arguments, load_config
from shared.curve import CurveKeys, start_authenticator
from shared.heap import freeze_startup_heap
from shared.ipc import report_ready

log = logging.getLogger("pagoda.frontend")
DRAIN_POLL_S = 0.05  # how often the drain looks at the in-flight count
# After the engine link failed every request in flight has been failed: this long for
# their streams to write the error event and [DONE] before the loops are cut
FAILED_LINK_DRAIN_S = 2.0
LINK_FAILED_TASK = "engine-link-failed"


class FrontendApi(Protocol):
    """One client-facing API of a frontend process (native ZMQ, HTTP)."""

    @property
    def num_inflight(self) -> int: ...

    async def serve(self) -> None: ...  # until cancelled

    def stop_accepting(self) -> None: ...

    async def abort_all(self) -> None: ...

    async def close(self) -> None: ...


def served_model_names(model_dir: str, served_model_name: str | None) -> tuple[str, ...]:
    """The ids requests may name: the served names (comma-separated, the first is the one
    responses report, as vLLM's ``--served-model-name``), then the directory and its base
    name."""
    names = [n.strip() for n in (served_model_name or "").split(",") if n.strip()]
    for name in (model_dir, os.path.basename(os.path.normpath(model_dir))):
        if name and name not in names:
            names.append(name)
    return tuple(names)


def make_frontend_id(index: int) -> str:
    host = socket.gethostname()[:64] or "host"
    return f"frontend-{index}-{host}-{os.getpid()}"


def build_apis(core: FrontendCore, ctx: zmq.asyncio.Context, config: PagodaConfig,
               curve: CurveKeys | None = None) -> list[FrontendApi]:
    """Every API this process serves: the native ZMQ API and the OpenAI-compatible HTTP API."""
    proc = config.process
    http = HttpApi(core, config)  # binds http_host:http_port (SO_REUSEPORT)
    try:
        native = NativeApi(ctx, config.endpoints.frontend_native[proc.frontend_index], core,
                           hwm=proc.socket_hwm, allow_wildcard=proc.allow_wildcard_bind,
                           curve=curve)
    except BaseException:
        http.discard()
        raise
    return [native, http]


async def run_frontend(config: PagodaConfig, ready_fd: int | None = None) -> int:
    # signals first: a SIGTERM that comes during start-up (or right after the ready
    # report) is handled as a shutdown, not by Python's default handler
    signals = _Signals(asyncio.get_running_loop())
    try:
        return await _run(config, ready_fd, signals)
    finally:
        signals.remove()


class _Signals:
    """SIGTERM/SIGINT as events: the first asks to stop, the second to skip the drain."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stop, self.force = asyncio.Event(), asyncio.Event()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.force if self.stop.is_set() else self.stop).set()

    def remove(self) -> None:
        for sig in self.SIGNALS:
            self.loop.remove_signal_handler(sig)


async def _run(config: PagodaConfig, ready_fd: int | None, signals: _Signals) -> int:
    proc = config.process
    model_dir = Path(config.engine.model).expanduser()
    if not model_dir.is_dir():
        raise ValueError(f"{config.engine.model!r} is not a model directory; start roles through "
                         "`pagoda <role>`, which resolves model names")
    limits = load_limits(model_dir, config.engine.max_model_len)
    processor = InputProcessor(load_tokenizer(model_dir), limits)
    frontend_id = make_frontend_id(proc.frontend_index)
    counter = MalformedFrameCounter(logging.getLogger("pagoda.frontend.wire"))
    curve = proc.load_curve_keys()
    ctx = zmq.asyncio.Context()
    authenticator = start_authenticator(ctx, curve)  # before the native API binds
    stats = EngineStatsView(frontend_id, counter)
    engine = EngineClient(ctx, config.endpoints.scheduler_frontend, frontend_id, counter,
                          hwm=proc.socket_hwm, stats=stats, startup_s=proc.startup_timeout_s,
                          curve=curve, fault=proc.fault)
    core = FrontendCore(frontend_id, processor, engine, counter, stats,
                        served_model_names(config.engine.model, proc.served_model_name),
                        ToolCalling.from_setting(proc.tool_call_parser, processor.tokenizer))
    apis: list[FrontendApi] = []
    try:
        apis = build_apis(core, ctx, config, curve)
        engine.start()
        serving = [asyncio.create_task(api.serve(), name="api-serve") for api in apis]
        # the engine link's receive loop dying ends the process like an API loop's end
        serving.append(asyncio.create_task(engine.failed.wait(), name=LINK_FAILED_TASK))
        native = config.endpoints.frontend_native[proc.frontend_index]
        freeze_startup_heap()  # the tokenizer and the web app live as long as the process
        print(f"pagoda frontend {frontend_id} ready: native API at {native}, "
              f"max_model_len {limits.max_model_len}", flush=True)
        if ready_fd is not None:
            report_ready(ready_fd, role="frontend", frontend_id=frontend_id, native=native)
        return await _serve_until_signal(apis, serving, proc.shutdown_timeout_s, signals, stats)
    finally:
        for api in apis:
            await api.close()
        await engine.close()
        if authenticator is not None:
            authenticator.stop()
        ctx.term()  # waits for the linger of the last aborts and outputs
        log.info("frontend %s stopped (dropped malformed frames: %s)", frontend_id,
                 counter.snapshot() or "none")


async def _serve_until_signal(
    apis: list[FrontendApi], serving: list[asyncio.Task[None]], drain_s: float,
    signals: _Signals, core_stats: EngineStatsView | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    stop, force = signals.stop, signals.force
    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stop_wait, *serving], return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    if stop_wait not in done:  # an API loop ended by itself: a bug, fail loudly
        stop_wait.cancel()
        log.error("a frontend loop ended unexpectedly: %s",
                  [(t.get_name(), t.exception()) for t in done if not t.cancelled()])
        rc = 1
        link_failed = any(t.get_name() == LINK_FAILED_TASK for t in done)
        drain_s = FAILED_LINK_DRAIN_S if link_failed else 0.0
    log.info("frontend stopping: draining %d request(s) for up to %.0fs",
             sum(a.num_inflight for a in apis), drain_s)
    for api in apis:
        api.stop_accepting()
    if core_stats is not None:
        core_stats.set_draining()
    deadline = loop.time() + drain_s
    while any(a.num_inflight for a in apis) and not force.is_set():
        if loop.time() >= deadline:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(force.wait(), min(DRAIN_POLL_S, deadline - loop.time()))
    for api in apis:
        await api.abort_all()
    for task in serving:
        task.cancel()
    await asyncio.gather(*serving, return_exceptions=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda frontend",
                                     description="run one tokenizer frontend")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    add_arguments(parser, groups=("endpoints", "engine", "process"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s frontend %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
        config.process.load_curve_keys(binds=True, connects=True)
    except ConfigError as e:
        print(f"pagoda frontend: {e}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(run_frontend(config, args.ready_fd))
    except (ValueError, OSError, zmq.ZMQError) as e:  # bad model dir / max_model_len, address in use
        log.error("frontend failed to start: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
