"""``pagoda worker|frontend`` resolve the model before the role starts: the services take
only a directory (they never import pagoda), the HTTP API keeps the name as given."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.cli import _resolve_role_model, main


def test_a_name_becomes_its_directory_and_the_served_name(smollm2_dir: Path) -> None:
    argv = _resolve_role_model(["--model", "smollm2", "--rank", "0"])
    assert argv == ["--model", "smollm2", "--rank", "0",
                    "--model", str(smollm2_dir), "--served-model-name", "smollm2"]


def test_the_model_from_the_environment_and_an_explicit_served_name(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGODA_MODEL", str(tiny_llama_dir))
    assert _resolve_role_model([])[-4:] == [
        "--model", str(tiny_llama_dir.resolve()), "--served-model-name", str(tiny_llama_dir)]
    monkeypatch.setenv("PAGODA_SERVED_MODEL_NAME", "tiny")
    assert _resolve_role_model([])[-1] == "tiny"
    assert _resolve_role_model(["--served-model-name", "mine"])[-1] == "mine"


def test_help_fetches_nothing() -> None:
    assert _resolve_role_model(["--model", "no-such-model", "--help"]) == [
        "--model", "no-such-model", "--help"]


def test_an_unknown_model_is_refused_before_the_role_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["worker", "--model", str(tmp_path / "missing")]) == 2
    assert "pagoda worker: model not found" in capsys.readouterr().err


def test_the_worker_alone_refuses_a_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    from services.worker.main import main as worker_main

    assert worker_main(["--model", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "'smollm2' is not a model directory" in err and "`pagoda worker`" in err
