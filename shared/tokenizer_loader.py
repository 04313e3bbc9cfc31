"""The project's one tokenizer loader: the frontends (``services/tokenizer``), the
offline ``LLM`` and the scheduler (which needs the vocabulary to compile structured-output
grammars) load a model directory's tokenizer the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's HF tokenizer, or None when the directory has no tokenizer files.

    Directories that ``pagoda fetch`` writes name ``PreTrainedTokenizerFast``; loading
    that class directly gives the same tokenizer as ``AutoTokenizer`` without importing
    torch (seconds of start-up). Anything else goes through ``AutoTokenizer``.
    """
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    if tc.get("tokenizer_class") == "PreTrainedTokenizerFast":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
