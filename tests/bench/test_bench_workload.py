"""pagoda.bench.workload: seeded synthetic workloads, exact lengths, prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench.workload import (
    LengthDist,
    Workload,
    arrival_times,
    corpus_text,
    load_jsonl,
    make_workload,
    parse_records,
)


def char_tokenizer(text: str, **_: object) -> dict[str, list[int]]:
    """One token per character: lengths are easy to check by hand."""
    return {"input_ids": [3 + ord(c) % 400 for c in text]}


def test_length_dist_parse() -> None:
    assert LengthDist.parse("uniform:32,512") == LengthDist(32, 512)
    assert LengthDist.parse("32,512") == LengthDist(32, 512)
    assert LengthDist.parse("fixed:7") == LengthDist(7, 7) == LengthDist.parse("7")
    assert str(LengthDist(7, 7)) == "fixed:7" and str(LengthDist(1, 2)) == "uniform:1,2"
    for bad in ("normal:1,2", "uniform:5", "fixed:1,2", "0,4", "9,3"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_seeded_workload_is_identical_and_seed_matters() -> None:
    a = make_workload(char_tokenizer, 20, (8, 64), (4, 32), seed=5)
    b = make_workload(char_tokenizer, 20, (8, 64), (4, 32), seed=5)
    c = make_workload(char_tokenizer, 20, (8, 64), (4, 32), seed=6)
    assert a == b
    assert a != c


def test_lengths_are_exact_and_in_range() -> None:
    fixed = make_workload(char_tokenizer, 10, LengthDist.parse("fixed:40"), LengthDist.parse("fixed:9"))
    assert [len(p) for p in fixed.prompts] == [40] * 10 and fixed.output_lens == [9] * 10
    work = make_workload(char_tokenizer, 200, (32, 512), (16, 256), seed=1)
    assert all(32 <= len(p) <= 512 for p in work.prompts)
    assert all(16 <= n <= 256 for n in work.output_lens)
    # uniform, not stuck at one end
    assert min(map(len, work.prompts)) < 100 and max(map(len, work.prompts)) > 440
    assert work.num_output_tokens == sum(work.output_lens)


def test_prompts_are_cut_from_real_text() -> None:
    text_ids = char_tokenizer(corpus_text())["input_ids"]
    assert len(corpus_text().split()) > 500  # prose, several docstrings
    doubled = text_ids * 4
    work = make_workload(char_tokenizer, 5, (20, 60), (1, 2), seed=2)
    for p in work.prompts:
        assert any(doubled[i : i + len(p)] == p for i in range(len(text_ids)))


def test_no_tokenizer_gives_random_ids_in_vocab() -> None:
    work = make_workload(None, 8, (10, 20), (3, 3), seed=0, vocab_size=50)
    assert all(3 <= t < 50 for p in work.prompts for t in p)
    assert work == make_workload(None, 8, (10, 20), (3, 3), seed=0, vocab_size=50)
    with pytest.raises(ValueError):
        make_workload(None, 8, (10, 20), (3, 3))


def test_salted_workload_differs_only_in_each_first_token() -> None:
    work = Workload([[5, 6, 7], [9], [99, 1]], [3, 1, 2])
    salted = work.salted(3, vocab_size=100)
    assert salted.prompts == [[8, 6, 7], [12], [2, 1]]  # wraps inside the vocabulary
    assert salted.output_lens == work.output_lens and work.prompts[0] == [5, 6, 7]
    assert work.salted(0, 100) == work
    with pytest.raises(ValueError, match="salt"):
        work.salted(100, 100)


def test_arrival_times() -> None:
    assert arrival_times(4, float("inf")) == [0.0] * 4
    a = arrival_times(2000, 10.0, seed=3)
    assert a == arrival_times(2000, 10.0, seed=3) and a[0] == 0.0
    assert a == sorted(a)
    assert 0.09 < a[-1] / 1999 < 0.11  # mean gap 1/rate
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_parse_plain_and_sharegpt_records() -> None:
    text = "\n".join([
        json.dumps({"prompt": "hello there"}),
        "",
        json.dumps({"prompt": "x", "output_len": 5}),
        json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}),
        json.dumps({"conversations": [{"from": "system", "value": "be nice"},
                                      {"from": "human", "value": "what is up"},
                                      {"from": "gpt", "value": "not much"}]}),
    ])
    recs = parse_records(text)
    assert [(r.prompt, r.prompt_token_ids, r.output_len) for r in recs] == [
        ("hello there", None, None), ("x", None, 5), (None, [5, 6, 7], 2),
        ("what is up", None, "not much"),
    ]
    # ShareGPT's own file: one JSON array
    array = json.dumps([{"conversations": [{"from": "human", "value": "q"}]}])
    assert [(r.prompt, r.output_len) for r in parse_records(array)] == [("q", None)]
    for bad in ('{"conversations": [{"from": "gpt", "value": "a"}]}', '{"text": "no prompt"}',
                '{"prompt_token_ids": []}', "[1, 2]"):
        with pytest.raises(ValueError):
            parse_records(bad)


def test_load_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "abcd"}),
        json.dumps({"prompt": "ef", "output_len": 5}),
        json.dumps({"conversations": [{"from": "human", "value": "ghi"},
                                      {"from": "gpt", "value": "reply!"}]}),
    ]) + "\n")
    work = load_jsonl(path, char_tokenizer, None, LengthDist(11, 11), seed=0)
    by_len = sorted(zip(map(len, work.prompts), work.output_lens))
    assert by_len == [(2, 5), (3, 6), (4, 11)]  # given, the reply's tokens, drawn
    assert load_jsonl(path, char_tokenizer, None, LengthDist(11, 11), seed=0) == work
    assert len(load_jsonl(path, char_tokenizer, 2, LengthDist(11, 11))) == 2
    with pytest.raises(ValueError, match="tokenizer"):
        load_jsonl(path, None, None, LengthDist(1, 1))
