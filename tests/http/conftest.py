"""One live `pagoda serve` for the HTTP tests: SmolLM2, 2 frontends on one HTTP port.

``--max-num-seqs 2 --max-queued-requests 1`` make the bounded queue easy to fill (two
long requests run, one waits, the next is refused), so the tests keep at most three
sequences in flight elsewhere. The offline ``LLM`` is the oracle, loaded once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.live_stack import LiveStack, start_stack, stop_stack


@pytest.fixture(scope="module")
def http_stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    log_path = tmp_path_factory.mktemp("http-serve") / "serve.log"
    stack = start_stack(smollm2_dir, log_path, 2, "--num-kv-blocks", "512", "--max-model-len",
                        "2048", "--max-num-seqs", "2", "--max-queued-requests", "1")
    try:
        yield stack
    finally:
        if stack.proc.poll() is None:  # the engine-death test ends the stack itself
            stop_stack(stack)


@pytest.fixture(scope="module")
def offline(smollm2_dir: Path) -> Any:
    from pagoda import LLM

    return LLM(str(smollm2_dir), dtype="float32", num_kv_blocks=256, max_model_len=2048)
