"""Incremental detokenization against whole-sequence decode, and stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from services.tokenizer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! Plain ASCII text.",
    "北京是中国的首都，上海是最大的城市。",
    "Emoji: 🐉🏯🎉 and a family 👨‍👩‍👧 in one grapheme.",
    "Mixed: café naïve — “quotes” ✓ 日本語 🙂 end",
]


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-style tokenizer: ASCII letters as tokens, everything else as <0xNN> bytes."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ,.!:;-— ":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def stream(tokenizer: object, ids: list[int], **kw: object) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, **kw)  # type: ignore[arg-type]
    deltas = [detok.push([i]).text for i in ids]
    deltas.append(detok.finish().text)
    return deltas, detok


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_stream_equals_full_decode(smol_tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = smol_tokenizer(text)["input_ids"]
    deltas, detok = stream(smol_tokenizer, ids)
    assert "".join(deltas) == smol_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert all("\ufffd" not in d for d in deltas), "a delta carried a broken UTF-8 sequence"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_stream_equals_full_decode(text: str) -> None:
    tok = byte_fallback_tokenizer()
    ids = tok.encode(text).ids
    assert any(i < 256 for i in ids) or text.isascii()
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_cuts_text_and_deltas_match(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "one two three STOP four five"
    ids = smol_tokenizer(text)["input_ids"]
    deltas, detok = stream(smol_tokenizer, ids, stop=["STOP", "never"])
    assert detok.stopped == "STOP"
    assert detok.text == "one two three " == "".join(deltas)


def test_stop_string_included_when_asked(smol_tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = smol_tokenizer("alpha beta<END> gamma")["input_ids"]
    deltas, detok = stream(smol_tokenizer, ids, stop=["<END>"], include_stop_str_in_output=True)
    assert detok.text == "alpha beta<END>" == "".join(deltas)


def test_earliest_stop_string_wins_and_holdback_releases_at_finish() -> None:
    tok = byte_fallback_tokenizer()
    detok = IncrementalDetokenizer(tok, stop=["xyz", "b"])
    pieces = [detok.push(tok.encode(c).ids).text for c in "aaxy"]
    assert "".join(pieces) == "aa"  # "xy" might still become "xyz"
    assert detok.finish().text == "xy"
    detok2 = IncrementalDetokenizer(tok, stop=["xyz", "b"])
    out = "".join(detok2.push(tok.encode(c).ids).text for c in "axybxyz")
    assert out == "axy" and detok2.stopped == "b"
