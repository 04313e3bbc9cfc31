"""Settings resolve as flag > PAGODA_* environment > default, into validated frozen configs."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from shared.config import (
    SETTINGS,
    SETTINGS_BY_KEY,
    ConfigError,
    Endpoints,
    EngineSettings,
    ProcessSettings,
    add_arguments,
    engine_settings,
    env_help,
    load_config,
    load_engine_settings,
    require_model_dir,
    resolve,
    resolve_setting,
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
        ({"PAGODA_KV_CACHE_DTYPE": "fp8"}, "PAGODA_KV_CACHE_DTYPE"),
        ({"PAGODA_DEVICE": "tpu"}, "device"),
        ({"PAGODA_HTTP_PORT": "70000"}, "http_port"),
        ({"PAGODA_SCHEDULER_STEP": "udp://x:1"}, "scheduler_step"),
        ({"PAGODA_FRONTEND_INDEX": "2"}, "frontend_index"),
        ({"PAGODA_SERVICE_NICE": "20"}, "service_nice"),
        ({"PAGODA_SERVICE_NICE": "-1"}, "service_nice"),
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


def test_every_row_has_an_env_var_and_help() -> None:
    envs = [s.env for s in SETTINGS]
    assert len(envs) == len(set(envs))
    for s in SETTINGS:
        assert s.env.startswith("PAGODA_") and s.env.isupper(), s.key
        assert s.help.strip(), f"{s.key} has no help"
        assert s.flag == "--" + s.key.replace("_", "-")
    # names that existed before the registry keep working
    assert SETTINGS_BY_KEY["cache_dir"].env == "PAGODA_CACHE"
    assert SETTINGS_BY_KEY["rank"].env == "PAGODA_RANK"
    assert SETTINGS_BY_KEY["testing"].env == "PAGODA_TESTING"
    assert SETTINGS_BY_KEY["attention_backend"].env == "PAGODA_ATTENTION_BACKEND"


@pytest.mark.parametrize("role", ["serve", "scheduler", "worker", "frontend"])
def test_role_help_lists_every_setting_with_its_env_var(
    role: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        main([role, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    missing = [s.env for s in SETTINGS if s.env not in text or s.flag not in text]
    assert not missing, f"pagoda {role} --help lacks {missing}"


@pytest.mark.parametrize(
    ("key", "flag", "env_text", "env_value", "default"),
    [
        ("rank", 0, "0", 0, 0),
        ("attention_backend", "cpu", "torch", "torch", "auto"),
        ("kv_cache_dtype", "bfloat16", "auto", "auto", "auto"),
        ("testing", False, "1", True, False),
        ("cache_dir", "/flag/cache", "/env/cache", "/env/cache", "~/.cache/pagoda"),
        ("served_model_name", "smollm2", "my-model", "my-model", None),
    ],
)
def test_new_rows_resolve_flag_over_env_over_default(
    key: str, flag: object, env_text: str, env_value: object, default: object
) -> None:
    env = {SETTINGS_BY_KEY[key].env: env_text}
    assert resolve_setting(key, flag, env) == flag
    assert resolve_setting(key, None, env) == env_value
    assert resolve_setting(key, None, {}) == default
    # the same through the configs every process loads
    group = SETTINGS_BY_KEY[key].group
    assert getattr(getattr(load_config({key: flag}, env), group), key) == flag
    assert getattr(getattr(load_config({}, env), group), key) == env_value
    assert getattr(getattr(load_config({}, {}), group), key) == default


def test_a_service_takes_only_a_model_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert require_model_dir(str(tiny_llama_dir), "worker") == tiny_llama_dir.resolve()
    for name in ("smollm2", str(tmp_path)):  # a name; a directory without config.json
        with pytest.raises(ConfigError, match="not a model directory.*`pagoda worker`"):
            require_model_dir(name, "worker")
    assert load_config({}, {"PAGODA_SERVED_MODEL_NAME": "none"}).process.served_model_name is None
    with pytest.raises(ConfigError, match="served_model_name"):
        ProcessSettings(served_model_name=" ")


def test_testing_and_rank_flags() -> None:
    config = load_config(parse("--testing", "--rank", "0"), {"PAGODA_TESTING": "0"})
    assert config.process.testing is True and config.process.rank == 0
    with pytest.raises(ConfigError, match="PAGODA_ATTENTION_BACKEND"):
        load_config(parse(), {"PAGODA_ATTENTION_BACKEND": "flash"})
    with pytest.raises(ConfigError, match="rank: 1 but tensor_parallel_size is 1"):
        load_config(parse("--rank", "1"), {})
    with pytest.raises(ConfigError, match="rank"):
        load_config(parse("--rank", "-1"), {})


@pytest.mark.parametrize("how", ["dataclass", "env", "flag"])
def test_tensor_parallel_size_is_read_and_checked(how: str) -> None:
    if how == "dataclass":
        assert EngineSettings(tensor_parallel_size=2).tensor_parallel_size == 2
        with pytest.raises(ConfigError, match="tensor_parallel_size: must be >= 1"):
            EngineSettings(tensor_parallel_size=0)
    elif how == "env":
        config = load_config(parse(), {"PAGODA_TENSOR_PARALLEL_SIZE": "2"})
        assert config.engine.tensor_parallel_size == 2
    else:
        config = load_config(parse("--tensor-parallel-size", "3", "--rank", "2"), {})
        assert (config.engine.tensor_parallel_size, config.process.rank) == (3, 2)


def test_engine_settings_names_an_unknown_key() -> None:
    names = {f.name for f in dataclasses.fields(EngineSettings)}
    assert engine_settings({n: getattr(EngineSettings(), n) for n in names}) == EngineSettings()
    with pytest.raises(TypeError, match="LLM.*'block_sise'"):
        engine_settings({"block_sise": 32}, caller="LLM")
    with pytest.raises(ConfigError, match="block_size"):
        engine_settings({"block_size": 0})


def test_load_engine_settings_flag_over_env() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, groups=("engine",))
    args = parser.parse_args(["--max-num-seqs", "4"])
    engine = load_engine_settings(args, {"PAGODA_MAX_NUM_SEQS": "8", "PAGODA_BLOCK_SIZE": "32"})
    assert (engine.max_num_seqs, engine.block_size) == (4, 32)


def test_llm_takes_exactly_the_engine_settings(tiny_llama_dir: Path) -> None:
    import inspect

    from pagoda.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    assert list(params) == ["self", "model", "settings"]  # model, then **settings
    assert params["model"].default == EngineSettings.model
    given = {f.name: getattr(EngineSettings(), f.name) for f in dataclasses.fields(EngineSettings)}
    given.update(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, device="cpu",
                 attention_backend="torch", block_size=8, max_num_seqs=4)
    llm = LLM(**given)
    assert llm.settings == EngineSettings(**given)
    assert llm.engine.runner.backend.name == "torch"
    assert llm.engine.scheduler.config.block_size == 8
    assert llm.engine.scheduler.config.max_num_seqs == 4
    assert llm.engine.scheduler.config.num_blocks == 16


def test_llm_refuses_an_unknown_kwarg_naming_it() -> None:
    from pagoda.llm import LLM

    with pytest.raises(TypeError, match="'strict_invariant'"):
        LLM("smollm2", strict_invariant=True)  # checked before any model is fetched
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM("smollm2", tensor_parallel_size=0)
