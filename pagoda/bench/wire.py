"""Wire codec micro-benchmark: frame bytes, encode and decode time of the per-step messages.

    python -m pagoda.bench.wire                          # the codec in this tree
    python -m pagoda.bench.wire --before /tmp/oldwire    # ... beside another version

``--before DIR`` names a directory holding another version's ``codec.py``,
``protocol.py`` and ``sampling_params.py`` (e.g. ``git show REV:shared/codec.py``);
it is measured in a subprocess in which ``shared`` is that copy. Both sides build the
same messages through their own classes; request ids on the worker link are whatever
that protocol declares (strings ``<frontend identity hex>/<id>-<index>``, as the
scheduler minted them before, or the compact int sequence ids).

Messages: a decode StepBatch (256 running requests, 1 in 16 gaining a block), a
prefill StepBatch (4 new requests of 512 prompt tokens + 32 decodes), a StepResult of
256 (without logprobs, and with 5 top logprobs for a quarter), EngineOutputs of 256.
Times are medians over many repetitions, in microseconds per call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
FRONTEND_IDENTITY = b"frontend-0-host-1".hex()  # a ROUTER identity, as the scheduler saw it


def build_messages(vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """The benchmark messages, built from whichever ``shared`` is importable."""
    from shared import protocol as P
    from shared.sampling_params import SamplingParams

    rng = random.Random(seed)
    int_ids = typing.get_type_hints(P.RunningRequest)["request_id"] is int

    def seq(i: int) -> Any:  # a worker-link request id
        return 1000 + i if int_ids else f"{FRONTEND_IDENTITY}/{1000 + i}-0"

    def block() -> int:
        return rng.randrange(40_000)

    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    running = [P.RunningRequest(seq(i), [block()] if i % 16 == 0 else []) for i in range(256)]
    decode_batch = P.StepBatch(100, [], running, [r.request_id for r in running], [1] * 256)
    new = [
        P.NewRequest(seq(300 + i), [rng.randrange(vocab_size) for _ in range(512)], 512,
                     params, [block() for _ in range(32)], 0)
        for i in range(4)
    ]
    prefill_batch = P.StepBatch(101, new, running[:32],
                                [r.request_id for r in new + running[:32]], [512] * 4 + [1] * 32)
    sampled = [rng.randrange(vocab_size) for _ in range(256)]
    ids = [r.request_id for r in running]

    def logprobs(i: int) -> Any:
        if i % 4:
            return None
        top = [rng.randrange(vocab_size) for _ in range(5)]
        return P.TokenLogprobs(-0.5, 1, top, [-0.5 - j * 0.7 for j in range(5)])

    # EngineOutput(s) were called RequestOutput(s) before the frontend redesign
    output_type = getattr(P, "EngineOutput", None) or P.RequestOutput
    outputs_type = getattr(P, "EngineOutputs", None) or P.RequestOutputs
    outputs = [output_type(str(1000 + i), 0, [sampled[i]], [], None, None, 300, 0)
               for i in range(256)]
    return {
        "StepBatch decode, 256 running": decode_batch,
        "StepBatch prefill, 4x512 new + 32": prefill_batch,
        "StepResult 256, no logprobs": P.StepResult(100, ids, sampled, [None] * 256),
        "StepResult 256, logprobs=5 for 64": P.StepResult(100, ids, sampled,
                                                         [logprobs(i) for i in range(256)]),
        "EngineOutputs 256": outputs_type(outputs),
    }


def _median_us(fn: Callable[[], Any], budget_s: float) -> float:
    """Median time of one call, from repetitions of a small loop."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(2e-4 / once))  # a repetition lasts about 0.2 ms
    reps = max(20, min(2000, int(budget_s / (once * inner))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter_ns() - t0) / inner / 1000)
    return statistics.median(times)


def measure(vocab_size: int, budget_s: float) -> dict[str, dict[str, float]]:
    """bytes, encode_us and decode_us of each message, with the importable codec."""
    from shared.codec import decode, encode

    results = {}
    for name, msg in build_messages(vocab_size).items():
        frame = encode(msg)
        assert decode(frame) == msg, name
        results[name] = {
            "bytes": len(frame),
            "encode_us": _median_us(lambda: encode(msg), budget_s),  # noqa: B023
            "decode_us": _median_us(lambda: decode(frame), budget_s),  # noqa: B023
        }
    return results


def measure_other(source: Path, vocab_size: int, budget_s: float) -> dict[str, Any]:
    """``measure`` in a subprocess where ``shared`` is the copy in ``source``."""
    with tempfile.TemporaryDirectory(prefix="pagoda-wire-") as tmp:
        pkg = Path(tmp, "shared")
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        for name in ("codec.py", "protocol.py", "sampling_params.py"):
            shutil.copy(source / name, pkg / name)
        # cwd comes first on sys.path with -m, so `shared` is the copy; pagoda from the repo
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        out = subprocess.run(
            [sys.executable, "-m", "pagoda.bench.wire", "--json",
             "--vocab-size", str(vocab_size), "--budget-s", str(budget_s)],
            cwd=tmp, env=env, check=True, capture_output=True, text=True,
        )
        return json.loads(out.stdout)


def table(before: dict[str, Any] | None, after: dict[str, Any]) -> str:
    if before is None:
        rows = ["| message | bytes | encode µs | decode µs |", "|---|---:|---:|---:|"]
        rows += [f"| {name} | {r['bytes']} | {r['encode_us']:.1f} | {r['decode_us']:.1f} |"
                 for name, r in after.items()]
        return "\n".join(rows)
    rows = [
        ("| message | bytes before | bytes after | encode µs before/after | "
         "decode µs before/after | bytes ×, encode ×faster, decode ×faster |"),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, a in after.items():
        b = before[name]
        rows.append(
            f"| {name} | {b['bytes']} | {a['bytes']} | "
            f"{b['encode_us']:.1f} / {a['encode_us']:.1f} | "
            f"{b['decode_us']:.1f} / {a['decode_us']:.1f} | "
            f"{a['bytes'] / b['bytes']:.2f}, {b['encode_us'] / a['encode_us']:.1f}, "
            f"{b['decode_us'] / a['decode_us']:.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda.bench.wire", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, default=None,
                   help="a directory with another version's codec.py, protocol.py, "
                        "sampling_params.py, measured beside this tree's")
    p.add_argument("--vocab-size", type=int, default=151_936,
                   help="token ids are uniform below this (default: Qwen2.5's, the largest "
                        "ids, the worst case for plain msgpack ints)")
    p.add_argument("--budget-s", type=float, default=0.5, help="time per measurement")
    p.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = p.parse_args(argv)
    after = measure(args.vocab_size, args.budget_s)
    if args.json:
        print(json.dumps(after))
        return 0
    before = measure_other(args.before, args.vocab_size, args.budget_s) if args.before else None
    print(table(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
