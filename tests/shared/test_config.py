"""Settings resolve as flag > PAGODA_* environment > default, into validated frozen configs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from shared.config import (
    SETTINGS,
    ConfigError,
    Endpoints,
    EngineSettings,
    ProcessSettings,
    add_arguments,
    env_help,
    load_config,
    resolve,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flag_beats_env_beats_default() -> None:
    env = {"PAGODA_BLOCK_SIZE": "32", "PAGODA_MAX_NUM_SEQS": "8", "PAGODA_DTYPE": "float16"}
    config = load_config(parse("--block-size", "64"), env)
    assert config.engine.block_size == 64  # flag
    assert config.engine.max_num_seqs == 8  # env
    assert config.engine.dtype == "float16"  # env
    assert config.engine.max_num_batched_tokens == EngineSettings().max_num_batched_tokens


def test_defaults_without_flags_or_env() -> None:
    config = load_config(parse(), env={})
    assert config.engine == EngineSettings()
    assert config.process == ProcessSettings()
    assert config.endpoints == Endpoints.loopback_tcp()
    assert all(a.startswith("tcp://127.0.0.1:") for _, a in config.endpoints.items())


def test_booleans_from_flags_and_env() -> None:
    env = {"PAGODA_ENABLE_PREFIX_CACHING": "0", "PAGODA_ALLOW_WILDCARD_BIND": "yes"}
    assert load_config(parse(), env).engine.enable_prefix_caching is False
    assert load_config(parse(), env).process.allow_wildcard_bind is True
    flags = parse("--enable-prefix-caching", "--no-allow-wildcard-bind")
    assert load_config(flags, env).engine.enable_prefix_caching is True
    assert load_config(flags, env).process.allow_wildcard_bind is False


def test_optional_and_size_values() -> None:
    env = {"PAGODA_KV_CACHE_BYTES": "2GiB", "PAGODA_NUM_KV_BLOCKS": "none"}
    engine = load_config(parse("--max-model-len", "4096"), env).engine
    assert engine.kv_cache_bytes == 2 * 2**30
    assert engine.num_kv_blocks is None and engine.max_model_len == 4096


def test_endpoints_from_env_and_flags_over_the_given_default(tmp_path: Path) -> None:
    local = Endpoints.local(tmp_path, num_frontends=2)
    env = {"PAGODA_SCHEDULER_STEP": "tcp://10.0.0.5:7001",
           "PAGODA_FRONTEND_NATIVE": "tcp://127.0.0.1:7100, tcp://127.0.0.1:7101"}
    config = load_config(parse("--scheduler-result", "tcp://127.0.0.1:7002"), env, local)
    assert config.endpoints.scheduler_frontend == local.scheduler_frontend  # default
    assert config.endpoints.scheduler_step == "tcp://10.0.0.5:7001"  # env
    assert config.endpoints.scheduler_result == "tcp://127.0.0.1:7002"  # flag
    assert config.endpoints.frontend_native == ("tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101")


def test_local_endpoints_are_ipc_files_in_the_run_dir(tmp_path: Path) -> None:
    endpoints = Endpoints.local(tmp_path, num_frontends=3)
    assert len(endpoints.frontend_native) == 3
    paths = endpoints.ipc_paths()
    assert len(paths) == 6 and len(set(paths)) == 6
    assert all(p.parent == tmp_path for p in paths)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"PAGODA_BLOCK_SIZE": "sixteen"}, "PAGODA_BLOCK_SIZE"),
        ({"PAGODA_ENABLE_PREFIX_CACHING": "maybe"}, "PAGODA_ENABLE_PREFIX_CACHING"),
        ({"PAGODA_KV_CACHE_BYTES": "4 parsecs"}, "PAGODA_KV_CACHE_BYTES"),
        ({"PAGODA_BLOCK_SIZE": "0"}, "block_size"),
        ({"PAGODA_DTYPE": "float8"}, "dtype"),
        ({"PAGODA_DEVICE": "tpu"}, "device"),
        ({"PAGODA_HTTP_PORT": "70000"}, "http_port"),
        ({"PAGODA_SCHEDULER_STEP": "udp://x:1"}, "scheduler_step"),
        ({"PAGODA_FRONTEND_INDEX": "2"}, "frontend_index"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(parse(), env)


def test_bad_flag_values_are_argparse_errors() -> None:
    with pytest.raises(SystemExit):
        parse("--block-size", "big")


def test_configs_are_frozen() -> None:
    config = load_config(parse(), {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.engine.block_size = 1  # type: ignore[misc]


def test_registry_is_complete_and_consistent() -> None:
    keys = [s.key for s in SETTINGS]
    assert len(keys) == len(set(keys))
    wanted = {f.name for cls in (Endpoints, EngineSettings, ProcessSettings)
              for f in dataclasses.fields(cls)}
    assert set(keys) == wanted
    assert all(s.env.startswith("PAGODA_") for s in SETTINGS)
    assert resolve({}, {}).keys() == set(keys)
    assert all(s.env in env_help() for s in SETTINGS)


def test_role_flags_subset() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, groups=("endpoints",))
    assert parser.parse_args(["--scheduler-step", "ipc:///x"]).scheduler_step == "ipc:///x"
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "16"])
