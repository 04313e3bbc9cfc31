"""Every command that takes a byte size (``--kv-cache-bytes``, ``--http-max-body-bytes``,
``--max-frame-bytes``) reads it as ``pagoda serve`` does: ``4GiB``, ``512MiB``, ``1e9`` or
a plain number of bytes (shared/config.py's parser, which ``add_arguments`` gives every
command's engine and process flags)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from pagoda import cli, launcher
from pagoda.bench import cli as bench_cli
from pagoda.bench import step_profile
from services.scheduler import main as scheduler_main
from services.tokenizer import main as frontend_main
from services.worker import main as worker_main

COMMANDS: dict[str, Callable[[list[str]], Any]] = {
    "serve": launcher.serve,
    "scheduler": scheduler_main.main,
    "worker": worker_main.main,
    "frontend": frontend_main.main,
    "bench": bench_cli.main,
    "step_profile": step_profile.main,
    "generate": lambda argv: cli.main(["generate", "hello", *argv]),
    "chat": lambda argv: cli.main(["chat", "hello", *argv]),
}
SIZES = {"4GiB": 4 * 2**30, "512MiB": 512 * 2**20, "1e9": 10**9, "65536": 65536, "8 kib": 8192}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        self.parser, self.namespace = parser, args


@pytest.fixture
def stop_after_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's parse_args hands back its parser and namespace, and the command stops."""
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        raise _Parsed(self, parse(self, *a, **kw))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A parser's options, its subcommands' too."""
    found = []
    for action in parser._actions:
        found.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += actions(sub)
    return found


def parsed(command: str, argv: list[str]) -> _Parsed:
    with pytest.raises(_Parsed) as caught:
        COMMANDS[command](argv)
    return caught.value


@pytest.mark.usefixtures("stop_after_parsing")
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_byte_size_flag_takes_units(command: str) -> None:
    got = parsed(command, ["--kv-cache-bytes", "4GiB"])
    assert got.namespace.kv_cache_bytes == 4 * 2**30
    byte_flags = [a for a in actions(got.parser) if a.dest.endswith("_bytes")]
    assert byte_flags, command
    for action in byte_flags:
        for text, value in SIZES.items():
            assert action.type(text) == value, (command, action.dest, text)  # type: ignore[misc]


def test_a_bad_size_is_a_usage_error_naming_the_form(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.build_parser().parse_args(["--kv-cache-bytes", "4 parsecs"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-bytes: expected a size such as 4GiB, got '4 parsecs'" in err

