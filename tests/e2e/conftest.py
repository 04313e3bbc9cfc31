"""The session's live stack: `pagoda serve` on SmolLM2 with 2 frontends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.live_stack import LiveStack, start_stack, stop_stack


@pytest.fixture(scope="session")
def live_stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    stack = start_stack(smollm2_dir, log_path, 2, "--num-kv-blocks", "2048",
                        "--max-model-len", "2048")
    try:
        yield stack
    finally:
        if stack.proc.poll() is None:
            stop_stack(stack)


