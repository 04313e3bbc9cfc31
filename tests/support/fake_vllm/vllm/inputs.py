"""The stand-in ``vllm.inputs`` (see the package's docstring)."""

from __future__ import annotations


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt_token_ids}
