"""Configuration of every pagoda process: all endpoints, engine and process settings.

Each value is declared once in ``SETTINGS`` (name, ``PAGODA_*`` environment variable,
type, default, help). ``add_arguments`` turns the table into argparse flags and
``load_config`` resolves each value as flag > environment > default into frozen
dataclasses. The offline ``LLM(**kwargs)`` takes exactly ``EngineSettings``'s fields
(``engine_settings``); a module with no config object at hand reads one row through
``resolve_setting`` (same order), never ``os.environ``. ``pagoda serve`` passes
``Endpoints.local(run_dir)`` as the default endpoints (ipc:// files in a private run
directory); a role started alone (``pagoda scheduler|worker|frontend``, what a container
runs) takes its addresses from flags or environment, else the loopback-TCP defaults.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shared.codec import MAX_FRAME_BYTES
from shared.curve import CurveError, CurveKeys, require_curve_support
from shared.faults import Fault
from shared.ipc import DEFAULT_HWM, check_address

DEFAULT_BASE_PORT = 5570  # scheduler: +0 frontends, +1 step, +2 results; frontends: +10 + i
DTYPES = ("auto", "float32", "float16", "bfloat16")
# auto: the model's dtype; bfloat16: a bf16 KV cache under an fp32 model too (CPU only,
# opt-in: it changes tokens against HF)
KV_CACHE_DTYPES = ("auto", "bfloat16")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")  # services/worker/attention/selector.py
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")  # tokenizer/tool_parsers.py
DEFAULT_CACHE_DIR = "~/.cache/pagoda"
KV_EVENTS_ENCODINGS = ("map", "array")  # services/scheduler/kv_events.py


class ConfigError(ValueError):
    """A setting with a bad value; the message names the flag or variable."""


@dataclass(frozen=True)
class Endpoints:
    """Every ZMQ address of one stack. Who binds and who connects is fixed per link."""

    # frontends -> scheduler (AddRequest, AbortRequest) and back (EngineOutputs, RequestError):
    # the scheduler binds a ROUTER, each frontend connects a DEALER whose identity is its id
    scheduler_frontend: str
    # scheduler -> workers (StepBatch): the scheduler binds an XPUB, every TP rank connects
    # a SUB, so each rank gets the same step from one send (not PUSH: it round-robins)
    scheduler_step: str
    # workers -> scheduler (WorkerReady from every rank, StepResult from rank 0):
    # the scheduler binds a PULL, each rank connects a PUSH
    scheduler_result: str
    # clients (pagoda.client) -> frontend i: frontend i binds a ROUTER, clients connect DEALERs
    frontend_native: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.frontend_native:
            raise ConfigError("frontend_native: at least one frontend address")
        for name, address in self.items():
            try:
                check_address(address)
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None

    def items(self) -> list[tuple[str, str]]:
        """(name, address) of every endpoint, frontends as ``frontend_native[i]``."""
        pairs = [
            ("scheduler_frontend", self.scheduler_frontend),
            ("scheduler_step", self.scheduler_step),
            ("scheduler_result", self.scheduler_result),
        ]
        pairs += [(f"frontend_native[{i}]", a) for i, a in enumerate(self.frontend_native)]
        return pairs

    def ipc_paths(self) -> list[Path]:
        """The socket files the ipc:// endpoints create (for cleanup checks)."""
        return [Path(a[len("ipc://"):]) for _, a in self.items() if a.startswith("ipc://")]

    @classmethod
    def local(cls, run_dir: str | Path, num_frontends: int = 1) -> Endpoints:
        """The embedded default: ipc:// socket files in a private run directory."""
        d = Path(run_dir)
        return cls(
            scheduler_frontend=f"ipc://{d / 'scheduler-frontend.sock'}",
            scheduler_step=f"ipc://{d / 'scheduler-step.sock'}",
            scheduler_result=f"ipc://{d / 'scheduler-result.sock'}",
            frontend_native=tuple(f"ipc://{d / f'frontend-{i}.sock'}" for i in range(num_frontends)),
        )

    @classmethod
    def loopback_tcp(
        cls, base_port: int = DEFAULT_BASE_PORT, num_frontends: int = 1, host: str = "127.0.0.1"
    ) -> Endpoints:
        """TCP on one host (loopback by default), ports from ``base_port`` up."""
        return cls(
            scheduler_frontend=f"tcp://{host}:{base_port}",
            scheduler_step=f"tcp://{host}:{base_port + 1}",
            scheduler_result=f"tcp://{host}:{base_port + 2}",
            frontend_native=tuple(f"tcp://{host}:{base_port + 10 + i}" for i in range(num_frontends)),
        )


@dataclass(frozen=True)
class EngineSettings:
    """What the scheduler and the workers need to build the engine."""

    # a model directory, or a name `pagoda fetch` knows: the CLI (`pagoda serve|<role>`) and
    # the offline LLM resolve a name to its directory; the service mains take only a directory
    model: str = "smollm2"
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # running requests per step
    max_num_batched_tokens: int = 2048  # tokens per step
    enable_prefix_caching: bool = True
    # schedule step N+1 while the workers run step N (services/scheduler/scheduler.py)
    async_scheduling: bool = True
    kv_cache_bytes: int | None = None  # KV pool size on CPU; None: the worker's default
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # one of DTYPES; auto: bfloat16 on CUDA and on CPUs where it is the faster dtype
    # (services/worker/runner_builder.cpu_runs_bf16_fast), else float32
    dtype: str = "auto"
    # one of KV_CACHE_DTYPES: the KV cache's element type (services/worker/runner_builder.
    # resolve_kv_cache_dtype); bfloat16 under a float32 model halves the bytes every
    # attention reads, at the cost of exact tokens (opt-in, as vLLM's --kv-cache-dtype)
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    tensor_parallel_size: int = 1  # worker ranks a model is split over (services/worker/parallel.py)
    max_queued_requests: int = 1024  # waiting requests before the scheduler answers overloaded
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS; auto: the selector's choice
    # CUDA graphs for decode steps (services/worker/cuda_graphs.py), only ever on CUDA:
    # enforce_eager turns them off; batches up to cuda_graph_max_batch_size sequences
    # are captured (None: min(max_num_seqs, 256))
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int | None = None
    # CUDA: the share of the GPU's memory the worker may use; the KV pool (unless sized
    # by kv_cache_bytes / num_kv_blocks) gets what weights, activations and graphs leave
    gpu_memory_utilization: float = 0.9
    # structured output (scheduler): a grammar not compiled this long after it was asked
    # for fails its requests; this many distinct compiled grammars are kept (LRU)
    grammar_compile_timeout_s: float = 30.0
    grammar_cache_size: int = 128

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "max_queued_requests", "grammar_cache_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("kv_cache_bytes", "num_kv_blocks", "max_model_len",
                     "cuda_graph_max_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}: must be >= 1, got {value}")
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError(f"grammar_compile_timeout_s: must be > 0, got "
                              f"{self.grammar_compile_timeout_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")


@dataclass(frozen=True)
class ProcessSettings:
    """How the processes start, talk and stop."""

    num_frontends: int = 1  # frontends `pagoda serve` starts
    frontend_index: int = 0  # which frontend_native address a frontend process binds
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    http_max_body_bytes: int = 8 * 2**20  # larger HTTP request bodies get 413
    # the model id the HTTP API answers to; None: the model setting as given. `pagoda serve`
    # and `pagoda <role>` set it to the name the user gave (e.g. smollm2), since the roles
    # themselves are handed the resolved model directory
    served_model_name: str | None = None
    # how the HTTP API finds tool calls in chat output: one of TOOL_CALL_PARSERS; auto:
    # from the chat template's text where it is clear, else none
    tool_call_parser: str = "auto"
    # the Responses API's store of finished responses (per frontend process), for
    # GET /v1/responses/{id} and previous_response_id: at most this many, each this long
    responses_max_stored: int = 1024
    responses_ttl_s: float = 3600.0
    # a key every HTTP API request must carry (Authorization: Bearer, or x-api-key);
    # None: no check. Passed to the frontends in the environment, never on a command line
    api_key: str | None = field(default=None, repr=False)  # one or more, comma-separated
    api_key_file: str | None = None  # more keys, one per line (a file only its owner reads)
    # with keys: the paths that stay open (probes, scrapers), comma-separated
    api_key_open_paths: str = "/health,/metrics,/tokenize,/detokenize"
    # CORS for browser clients, as vLLM names it: origins allowed (comma-separated, "*"
    # for any; none: no CORS headers), and the methods and headers they may use
    allowed_origins: str | None = None
    allowed_methods: str = "*"
    allowed_headers: str = "*"
    allow_credentials: bool = False
    # a wildcard or non-loopback ZMQ bind without CURVE: only on an isolated network
    allow_wildcard_bind: bool = False
    # CURVE on every ZMQ link: a directory of key files (shared/curve.py; `pagoda keys DIR`)
    curve_keys: str | None = None
    socket_hwm: int = DEFAULT_HWM
    max_frame_bytes: int = MAX_FRAME_BYTES
    # the CPU nice value `pagoda serve` starts the scheduler and frontends with (0-19): the
    # worker's threads fill the cores in lockstep, so a wake-up of theirs at the same
    # priority stalls a whole parallel step (~10% of the throughput on 2 cores); at a
    # lower priority they run in the gaps. 0: the worker's priority
    service_nice: int = 19
    startup_timeout_s: float = 300.0  # for a child's ready report (model load included)
    shutdown_timeout_s: float = 30.0  # drain time after SIGTERM
    step_timeout_s: float = 60.0  # a step without a result this long: the engine is dead
    rank: int = 0  # this worker's rank, < tensor_parallel_size (pagoda serve sets it per worker)
    # a tensor-parallel group's rendezvous (torch.distributed; rank 0 listens on it) and
    # how its ranks spread over hosts: `pagoda worker` on node R starts ranks
    # R*M/K .. (R+1)*M/K - 1 of the M ranks on K nodes
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: pagoda serve picks a free one
    nnodes: int = 1
    node_rank: int = 0
    testing: bool = False  # test mode: a broken scheduler invariant is fatal, not just counted
    fault: str | None = None  # test mode only: a failure on purpose (shared/faults.py)
    cache_dir: str = DEFAULT_CACHE_DIR  # where `pagoda fetch` puts models (env PAGODA_CACHE)
    # the scheduler's KV cache events in vLLM's format (services/scheduler/kv_events.py):
    # None: off. A wildcard, ipc:// or inproc:// address is bound, a tcp://host:port one
    # connected to (a subscriber that binds), as vLLM's --kv-events-config endpoint
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""  # the first frame of every batch (vLLM's default: empty)
    # each event as a map by field name (vLLM >= 0.24) or a positional array (<= 0.23)
    kv_events_encoding: str = "map"

    def __post_init__(self) -> None:
        if self.num_frontends < 1 or self.frontend_index < 0:
            raise ConfigError("num_frontends must be >= 1 and frontend_index >= 0")
        if self.rank < 0:
            raise ConfigError(f"rank: must be >= 0, got {self.rank}")
        if not 0 <= self.service_nice <= 19:
            raise ConfigError(f"service_nice: must be in [0, 19], got {self.service_nice}")
        if not self.cache_dir:
            raise ConfigError("cache_dir: must not be empty")
        if not 0 < self.http_port < 65536:
            raise ConfigError(f"http_port: must be in 1..65535, got {self.http_port}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.responses_max_stored < 0 or not self.responses_ttl_s > 0:
            raise ConfigError(f"responses_max_stored must be >= 0 and responses_ttl_s > 0, got "
                              f"{self.responses_max_stored} and {self.responses_ttl_s}")
        if self.fault is not None:
            if not self.testing:
                raise ConfigError("fault: fault injection runs only in test mode (--testing)")
            try:
                Fault.parse(self.fault)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key: must not be blank")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name: must not be blank")
        if self.http_max_body_bytes < 1024:
            raise ConfigError(f"http_max_body_bytes: must be >= 1024, got {self.http_max_body_bytes}")
        if self.socket_hwm < 1 or self.max_frame_bytes < 1024:
            raise ConfigError("socket_hwm must be >= 1 and max_frame_bytes >= 1024")
        if self.startup_timeout_s <= 0 or self.shutdown_timeout_s < 0:
            raise ConfigError("startup_timeout_s must be > 0 and shutdown_timeout_s >= 0")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"nnodes must be >= 1 and node_rank in 0..nnodes-1, got nnodes "
                              f"{self.nnodes}, node_rank {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master_port: must be in 1..65535, got {self.master_port}")
        if self.step_timeout_s <= 0:
            raise ConfigError(f"step_timeout_s: must be > 0, got {self.step_timeout_s}")
        if self.kv_events_endpoint is not None:
            try:
                check_address(self.kv_events_endpoint)
            except ValueError as e:
                raise ConfigError(f"kv_events_endpoint: {e}") from None
        if self.curve_keys is not None:
            try:
                require_curve_support()
            except CurveError as e:
                raise ConfigError(str(e)) from None
        if self.kv_events_encoding not in KV_EVENTS_ENCODINGS:
            raise ConfigError(f"kv_events_encoding: must be one of "
                              f"{', '.join(KV_EVENTS_ENCODINGS)}, got {self.kv_events_encoding!r}")

    def load_curve_keys(self, *, binds: bool = False, connects: bool = False) -> CurveKeys | None:
        """The CURVE keys of ``curve_keys``, or None when the plane runs without CURVE.

        ``binds`` / ``connects``: the role binds (needs the server pair and the allow-
        list) or connects (needs the client pair); checked now, so a role missing a key
        file refuses to start with the file's name instead of failing at its first link.
        """
        if self.curve_keys is None:
            return None
        try:
            keys = CurveKeys.load(self.curve_keys)
            if binds:
                keys.server_pair()
                keys.authorized_clients()
            if connects:
                keys.client_pair()
        except CurveError as e:
            raise ConfigError(f"curve_keys: {e}") from None
        return keys


@dataclass(frozen=True)
class PagodaConfig:
    endpoints: Endpoints
    engine: EngineSettings
    process: ProcessSettings


# -- the registry ----------------------------------------------------------------------------


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse_bytes(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1e9`` or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _SIZE_UNITS:
        raise ValueError(f"expected a size such as 4GiB, got {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        return None if text.strip().lower() in ("", "none") else parse(text)

    return parse_optional


def _parse_addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _choice(*names: str) -> Callable[[str], str]:
    def parse_choice(text: str) -> str:
        if text not in names:
            raise ValueError(f"expected one of {', '.join(names)}, got {text!r}")
        return text

    return parse_choice


@dataclass(frozen=True)
class Setting:
    """One value any process may need: its env var, flag, parser, default and help."""

    key: str  # the argparse dest and the dataclass field
    group: str  # "endpoints", "engine" or "process"
    parse: Callable[[str], Any]
    default: Any
    help: str
    env_name: str | None = None  # only where an older name must keep working

    @property
    def env(self) -> str:
        return self.env_name or "PAGODA_" + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


_ENGINE, _PROC, _EP = EngineSettings(), ProcessSettings(), "endpoints"
SETTINGS: tuple[Setting, ...] = (
    # endpoints: None means "from the default Endpoints" (local ipc for serve, else loopback TCP)
    Setting("scheduler_frontend", _EP, str, None, "scheduler ROUTER for frontends (it binds)"),
    Setting("scheduler_step", _EP, str, None, "scheduler XPUB for steps to workers (it binds)"),
    Setting("scheduler_result", _EP, str, None, "scheduler PULL for worker results (it binds)"),
    Setting("frontend_native", _EP, _parse_addresses, None,
            "comma-separated native-API ROUTER address of each frontend (each binds its own)"),
    Setting("model", "engine", str, _ENGINE.model, "model directory or known name"),
    Setting("block_size", "engine", int, _ENGINE.block_size, "tokens per KV block"),
    Setting("max_num_seqs", "engine", int, _ENGINE.max_num_seqs, "running requests per step"),
    Setting("max_num_batched_tokens", "engine", int, _ENGINE.max_num_batched_tokens,
            "token budget per step"),
    Setting("enable_prefix_caching", "engine", _parse_bool, _ENGINE.enable_prefix_caching,
            "reuse cached KV blocks of shared prefixes"),
    Setting("async_scheduling", "engine", _parse_bool, _ENGINE.async_scheduling,
            "schedule the next step while the workers run this one (same tokens either way)"),
    Setting("kv_cache_bytes", "engine", _optional(_parse_bytes), None, "KV pool size, e.g. 4GiB"),
    Setting("num_kv_blocks", "engine", _optional(int), None, "KV pool size in blocks"),
    Setting("max_model_len", "engine", _optional(int), None, "longest prompt + output"),
    Setting("dtype", "engine", str, _ENGINE.dtype, f"one of {', '.join(DTYPES)}"),
    Setting("kv_cache_dtype", "engine", _choice(*KV_CACHE_DTYPES), _ENGINE.kv_cache_dtype,
            "KV cache element type; auto: the model's dtype; bfloat16 also under a float32 "
            "model (CPU only; halves the attention's bytes, tokens may differ from HF)"),
    Setting("device", "engine", str, _ENGINE.device, "auto, cpu, cuda or cuda:N"),
    Setting("tensor_parallel_size", "engine", int, _ENGINE.tensor_parallel_size,
            "worker ranks the model is split over (tensor parallelism)"),
    Setting("max_queued_requests", "engine", int, _ENGINE.max_queued_requests,
            "waiting requests before new ones are refused as overloaded"),
    Setting("attention_backend", "engine", _choice(*ATTENTION_BACKENDS), _ENGINE.attention_backend,
            "worker attention backend; auto: triton on CUDA, else the cpu kernel if it builds, "
            "else torch"),
    Setting("enforce_eager", "engine", _parse_bool, _ENGINE.enforce_eager,
            "never capture CUDA graphs (decode steps run eagerly; CPUs always do)"),
    Setting("cuda_graph_max_batch_size", "engine", _optional(int), None,
            "largest decode batch captured in a CUDA graph (default: min(max_num_seqs, 256))"),
    Setting("gpu_memory_utilization", "engine", float, _ENGINE.gpu_memory_utilization,
            "CUDA: share (0-1] of the GPU's memory the worker uses; the KV pool gets what "
            "the weights, a profiled step's activations and the graphs leave"),
    Setting("grammar_compile_timeout_s", "engine", float, _ENGINE.grammar_compile_timeout_s,
            "structured output: seconds a grammar may take to compile before its requests fail"),
    Setting("grammar_cache_size", "engine", int, _ENGINE.grammar_cache_size,
            "structured output: compiled grammars kept for reuse (LRU)"),
    Setting("num_frontends", "process", int, _PROC.num_frontends, "frontends serve starts"),
    Setting("frontend_index", "process", int, _PROC.frontend_index,
            "which frontend_native address this frontend binds"),
    Setting("http_host", "process", str, _PROC.http_host, "HTTP API host"),
    Setting("http_port", "process", int, _PROC.http_port, "HTTP API port"),
    Setting("http_max_body_bytes", "process", _parse_bytes, _PROC.http_max_body_bytes,
            "largest HTTP request body accepted (larger: 413), e.g. 8MiB"),
    Setting("served_model_name", "process", _optional(str), None,
            "model id(s) the HTTP API answers to, comma-separated, the first one reported "
            "(default: the model as named on the command line, and its alias)"),
    Setting("tool_call_parser", "process", _choice(*TOOL_CALL_PARSERS), _PROC.tool_call_parser,
            "format of tool calls in chat output (services/tokenizer/tool_parsers.py); auto: "
            "the one the chat template shows (hermes for <tool_call>), else none"),
    Setting("responses_max_stored", "process", int, _PROC.responses_max_stored,
            "Responses API: finished responses each frontend keeps for GET /v1/responses/{id} "
            "and previous_response_id, oldest dropped first (0: none)"),
    Setting("responses_ttl_s", "process", float, _PROC.responses_ttl_s,
            "Responses API: seconds a stored response is kept"),
    Setting("api_key", "process", _optional(str), None,
            "key the HTTP API requires on /v1 routes (Authorization: Bearer <key> or "
            "x-api-key: <key>); prefer the PAGODA_API_KEY environment variable"),
    Setting("api_key_file", "process", _optional(str), None,
            "file of API keys the HTTP API accepts, one per line (besides --api-key); it "
            "must not be readable by group or others"),
    Setting("api_key_open_paths", "process", str, _PROC.api_key_open_paths,
            "with API keys, the HTTP paths that need none, comma-separated (empty: none); "
            "every other path needs a key"),
    Setting("allowed_origins", "process", _optional(str), None,
            "CORS: origins browsers may call the HTTP API from, comma-separated ('*': any)"),
    Setting("allowed_methods", "process", str, _PROC.allowed_methods,
            "CORS: methods allowed, comma-separated"),
    Setting("allowed_headers", "process", str, _PROC.allowed_headers,
            "CORS: request headers allowed, comma-separated"),
    Setting("allow_credentials", "process", _parse_bool, _PROC.allow_credentials,
            "CORS: allow credentials (cookies, Authorization)"),
    Setting("allow_wildcard_bind", "process", _parse_bool, _PROC.allow_wildcard_bind,
            "allow a ZMQ bind on tcp://*, 0.0.0.0 or a non-loopback host without CURVE "
            "(isolated networks only)"),
    Setting("curve_keys", "process", _optional(str), None,
            "encrypt and authenticate every ZMQ link with the CURVE keys in this directory "
            "(make them with `pagoda keys DIR`)"),
    Setting("socket_hwm", "process", int, _PROC.socket_hwm, "ZMQ high-water mark (messages)"),
    Setting("max_frame_bytes", "process", _parse_bytes, _PROC.max_frame_bytes,
            "largest ZMQ frame accepted"),
    Setting("service_nice", "process", int, _PROC.service_nice,
            "CPU nice value (0-19) serve gives the scheduler and frontends, below the "
            "worker's; 0: the same as the worker"),
    Setting("startup_timeout_s", "process", float, _PROC.startup_timeout_s,
            "seconds to wait for a child process to report ready (and a frontend, for "
            "the engine's first answer before it fails the requests it holds)"),
    Setting("shutdown_timeout_s", "process", float, _PROC.shutdown_timeout_s,
            "seconds to drain on SIGTERM"),
    Setting("step_timeout_s", "process", float, _PROC.step_timeout_s,
            "seconds the scheduler waits for a step's result before failing every request"),
    Setting("rank", "process", int, _PROC.rank,
            "this worker's rank (pagoda serve passes --rank to each worker)"),
    Setting("master_addr", "process", str, _PROC.master_addr,
            "tensor parallelism: the host of rank 0's rendezvous (torch.distributed)"),
    Setting("master_port", "process", _optional(int), None,
            "tensor parallelism: the rendezvous port (pagoda serve picks a free one)"),
    Setting("nnodes", "process", int, _PROC.nnodes,
            "tensor parallelism: the hosts a group's ranks are spread over"),
    Setting("node_rank", "process", int, _PROC.node_rank,
            "tensor parallelism: this host's index (pagoda worker starts its ranks)"),
    Setting("testing", "process", _parse_bool, _PROC.testing,
            "test mode: a broken scheduler invariant is fatal (the test suite sets it)"),
    Setting("fault", "process", _optional(str), None,
            "test mode only: fail on purpose, e.g. worker_raise_after=3 (shared/faults.py)"),
    Setting("cache_dir", "process", str, _PROC.cache_dir,
            "directory of fetched models (pagoda fetch)", env_name="PAGODA_CACHE"),
    Setting("kv_events_endpoint", "process", _optional(str), None,
            "publish vLLM-format KV cache events (ZMQ, msgpack) here, e.g. tcp://*:5557 "
            "(bound; a wildcard needs --allow-wildcard-bind), ipc:///path (bound) or "
            "tcp://host:5557 (connected to a subscriber that binds); default: off"),
    Setting("kv_events_topic", "process", str, _PROC.kv_events_topic,
            "topic (first frame) of every KV event batch, e.g. kv-events"),
    Setting("kv_events_encoding", "process", _choice(*KV_EVENTS_ENCODINGS),
            _PROC.kv_events_encoding,
            "KV events as maps by field name (map: vLLM >= 0.24) or positional arrays "
            "(array: vLLM <= 0.23 subscribers)"),
)
SETTINGS_BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def add_arguments(parser: argparse.ArgumentParser, groups: tuple[str, ...] | None = None) -> None:
    """Add a flag for each setting (of ``groups``, default all); unset flags stay None."""
    for group in ("endpoints", "engine", "process"):
        if groups is not None and group not in groups:
            continue
        arg_group = parser.add_argument_group(group)
        for s in SETTINGS:
            if s.group != group:
                continue
            help_text = f"{s.help} [env {s.env}; default {s.default}]"
            if s.parse is _parse_bool:
                arg_group.add_argument(s.flag, dest=s.key, default=None,
                                       action=argparse.BooleanOptionalAction, help=help_text)
            else:
                arg_group.add_argument(s.flag, dest=s.key, default=None,
                                       type=_flag_type(s.parse), help=help_text)


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse, which shows an ArgumentTypeError's message (a ValueError
    becomes "invalid parse_optional value"); int, float and str keep argparse's wording."""
    if parse in (int, float, str):
        return parse

    def parse_flag(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_flag


def resolve(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Every setting's value: the flag if given, else its PAGODA_* variable, else the default."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if env is None else env
    return {s.key: _resolve_one(s, given.get(s.key), env) for s in SETTINGS}


def _resolve_one(s: Setting, flag: Any, env: Mapping[str, str]) -> Any:
    if flag is not None:
        return flag
    if s.env in env:
        try:
            return s.parse(env[s.env])
        except ValueError as e:
            raise ConfigError(f"{s.env}: {e}") from None
    return s.default


def resolve_setting(key: str, flag: Any = None, env: Mapping[str, str] | None = None) -> Any:
    """One row's value, flag > its environment variable > default: for a module that has
    no config object at hand (the model cache, the attention backend of a bare runner)."""
    return _resolve_one(SETTINGS_BY_KEY[key], flag, os.environ if env is None else env)


def load_engine_settings(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> EngineSettings:
    """The engine settings alone, flag > environment > default (``pagoda generate|chat``)."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if env is None else env
    return EngineSettings(**{f.name: _resolve_one(SETTINGS_BY_KEY[f.name], given.get(f.name), env)
                             for f in fields(EngineSettings)})


def engine_settings(values: Mapping[str, Any], caller: str = "EngineSettings") -> EngineSettings:
    """``EngineSettings(**values)``, with a TypeError naming any key that is not a setting."""
    names = [f.name for f in fields(EngineSettings)]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise TypeError(f"{caller}() got unknown engine setting(s) {', '.join(map(repr, unknown))}; "
                        f"the engine settings are: {', '.join(names)}")
    return EngineSettings(**values)


def load_config(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    default_endpoints: Endpoints | None = None,
) -> PagodaConfig:
    """Resolve every setting into frozen configs; ConfigError names a bad value."""
    values = resolve(args, env)
    base = default_endpoints or Endpoints.loopback_tcp(num_frontends=values["num_frontends"])
    endpoints = Endpoints(**{
        f.name: values[f.name] if values[f.name] is not None else getattr(base, f.name)
        for f in fields(Endpoints)
    })
    engine = EngineSettings(**{f.name: values[f.name] for f in fields(EngineSettings)})
    process = ProcessSettings(**{f.name: values[f.name] for f in fields(ProcessSettings)})
    if process.frontend_index >= len(endpoints.frontend_native):
        raise ConfigError(
            f"frontend_index {process.frontend_index} but only "
            f"{len(endpoints.frontend_native)} frontend_native addresses"
        )
    if process.rank >= engine.tensor_parallel_size:
        raise ConfigError(f"rank: {process.rank} but tensor_parallel_size is {engine.tensor_parallel_size}")
    if engine.tensor_parallel_size % process.nnodes:
        raise ConfigError(f"tensor_parallel_size {engine.tensor_parallel_size} does not split "
                          f"over nnodes {process.nnodes}: each node runs the same number of ranks")
    return PagodaConfig(endpoints, engine, process)


def require_model_dir(model: str, role: str) -> Path:
    """The ``model`` setting as the directory a service loads; ConfigError naming the fix
    when it is not one (a name such as ``smollm2``: ``pagoda <role>`` resolves names)."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model: {model!r} is not a model directory (a directory with "
                          f"config.json); start roles through `pagoda {role}`, which resolves "
                          f"model names")
    return path.resolve()


def env_help() -> str:
    """One line per environment variable, for --help epilogs and docs."""
    return "\n".join(f"  {s.env:<36} {s.help} (default {s.default})" for s in SETTINGS)
