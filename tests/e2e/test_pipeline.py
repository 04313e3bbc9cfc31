"""The whole pipeline (pagoda serve: worker, scheduler, 2 frontends) against the offline LLM.

Oracle: `pagoda.LLM` in this process, same model, greedy. Faults checked: a client
process killed mid-stream, malformed frames on every bound socket, SIGTERM clean-up.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq

from pagoda.client import Client
from shared.codec import encode
from shared.protocol import AbortRequest
from shared.sampling_params import SamplingParams
from support.live_stack import REPO, LiveStack, expected_offline, start_stack, stop_stack

pytestmark = pytest.mark.slow

MULTIBYTE_PROMPTS = ["请用中文回答：北京是", "Write three emoji: 🐉🏯", "日本語で答えてください。東京は"]
WORDS = ["the", "river", "city", "light", "morning", "paper", "stone", "garden", "music", "winter",
         "quiet", "road", "north", "market", "bridge", "window", "story", "green", "tower"]
IDLE = re.compile(r"idle: running=(\d+) waiting=(\d+) kv_usage=([0-9.]+) .* invariant_failures=(\d+) "
                  r"malformed_frames=(\d+)")


def make_jobs(count: int, seed: int) -> tuple[list[str], list[dict]]:  # type: ignore[type-arg]
    rng = random.Random(seed)
    prompts = list(MULTIBYTE_PROMPTS)
    while len(prompts) < count:
        prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))))
    params = [{"temperature": 0.0, "max_tokens": rng.randint(4, 24)} for _ in prompts]
    return prompts, params


def run_clients(stack: LiveStack, prompts: list[str], params: list[dict], tmp: Path) -> list[dict]:  # type: ignore[type-arg]
    """Two client processes, each sending half of the jobs to its own frontend at once."""
    procs, outs = [], []
    for k, address in enumerate(stack.frontends[:2]):
        jobs = [{"prompt": p, "params": q, "stream": i % 2 == 0}
                for i, (p, q) in enumerate(zip(prompts, params)) if i % 2 == k]
        jobs_path, out_path = tmp / f"jobs{k}.json", tmp / f"out{k}.json"
        jobs_path.write_text(json.dumps(jobs))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests/e2e/client_proc.py"), address,
                                       str(jobs_path), str(out_path)], cwd=REPO))
        outs.append(out_path)
    for p in procs:
        assert p.wait(timeout=600) == 0
    halves = [json.loads(o.read_text()) for o in outs]
    return [halves[i % 2][i // 2] for i in range(len(prompts))]


def last_idle(stack: LiveStack, after: int) -> re.Match[str]:
    text = stack.wait_for_log(lambda t: IDLE.search(t) is not None, after=after)
    return list(IDLE.finditer(text))[-1]


def assert_idle_and_clean(stack: LiveStack, after: int) -> None:
    m = last_idle(stack, after)
    running, waiting, usage, failures = int(m.group(1)), int(m.group(2)), float(m.group(3)), int(m.group(4))
    assert (running, waiting, usage, failures) == (0, 0, 0.0, 0), m.group(0)


def test_64_requests_from_two_client_processes_match_offline(
        live_stack: LiveStack, smollm2_dir: Path, tmp_path: Path) -> None:
    prompts, params = make_jobs(64, seed=1)
    start = len(live_stack.log())
    got = run_clients(live_stack, prompts, params, tmp_path)
    expected = expected_offline(smollm2_dir, prompts, [SamplingParams(**q) for q in params])
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g["token_ids"] == e.outputs[0].token_ids, f"request {i} ({prompts[i][:30]!r}) differs"
        assert g["text"] == e.outputs[0].text, f"request {i}: streamed text differs"
        assert g["finish_reason"] == e.outputs[0].finish_reason
    assert any(ord(c) > 0x2E80 for g in got[:3] for c in g["text"]), "no CJK/emoji text was produced"
    assert_idle_and_clean(live_stack, start)


def test_killed_client_is_aborted_and_its_blocks_freed(live_stack: LiveStack, smollm2_dir: Path,
                                                       tmp_path: Path) -> None:
    jobs = tmp_path / "long.json"
    jobs.write_text(json.dumps([{"prompt": "Tell me a very long story about a dragon.", "stream": True,
                                 "params": {"temperature": 0.0, "max_tokens": 1500, "ignore_eos": True}}]))
    start = len(live_stack.log())
    victim = subprocess.Popen([sys.executable, str(REPO / "tests/e2e/client_proc.py"),
                               live_stack.frontends[0], str(jobs), "-"], stdout=subprocess.PIPE, cwd=REPO)
    assert victim.stdout is not None and victim.stdout.readline().strip() == b"first-delta"
    canary_prompt = "The three primary colours are"
    canary_params = SamplingParams(temperature=0.0, max_tokens=24)
    with Client(live_stack.frontends[1], timeout=300) as client:
        victim.kill()
        victim.wait()
        got = client.generate(canary_prompt, temperature=0.0, max_tokens=24)
    expected = expected_offline(smollm2_dir, [canary_prompt], [canary_params])[0].outputs[0]
    assert got.outputs[0].token_ids == expected.token_ids
    live_stack.wait_for_log(lambda t: "disconnected: aborted its 1 request(s)" in t, after=start)
    # and the scheduler went idle with every block back and the invariant intact
    assert_idle_and_clean(live_stack, start)


def _nice(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[16])  # field 19 of stat(5)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_scheduler_and_frontends_run_below_the_worker(live_stack: LiveStack) -> None:
    """service_nice (default 19): the worker keeps the launcher's priority, the roles whose
    wake-ups would stall its lockstep threads run at the lowest."""
    base = _nice(live_stack.proc.pid)
    low = min(19, base + 19) - base  # nice values stop at 19
    assert {name: _nice(pid) - base for name, pid in live_stack.pids.items()} == {
        "worker-0": 0, "scheduler": low, "frontend-0": low, "frontend-1": low}


def test_malformed_frames_on_every_bound_socket_are_dropped(live_stack: LiveStack) -> None:
    start = len(live_stack.log())
    pack = msgspec.msgpack.encode
    garbage = [b"\x00\xffnot msgpack", pack([1, [1, "r", [1, 2, 3]]])[:-3], b"\x93\x01",
               pack([1, [1, "too", "few"]]), pack([1, [99]]), pack({"a": 1})]
    ctx = zmq.Context()
    socks = []
    try:
        def connect(kind: int, address: str) -> zmq.Socket:  # type: ignore[type-arg]
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(address)
            socks.append(s)
            return s

        for address in [live_stack.scheduler["frontend"], *live_stack.frontends]:
            dealer = connect(zmq.DEALER, address)
            for frame in garbage:
                dealer.send(frame)
            dealer.send_multipart([b"extra", encode(AbortRequest(["x"]))])  # wrong frame count
        push = connect(zmq.PUSH, live_stack.scheduler["result"])
        for frame in garbage:
            push.send(frame)
        xsub = connect(zmq.XSUB, live_stack.scheduler["step"])
        xsub.send(b"\x02garbage")
        xsub.send(b"\x01topic")
        xsub.send(b"\x00topic")
        # the stack still serves, and says what it dropped
        with Client(live_stack.frontends[0], timeout=300) as client:
            out = client.generate("Hello", temperature=0.0, max_tokens=4)
        assert out.outputs[0].finish_reason == "length"
    finally:
        for s in socks:
            s.close()
        ctx.term()
    text = live_stack.wait_for_log(
        lambda t: "dropped malformed frame on scheduler_frontend" in t
        and "dropped malformed frame on frontend_native" in t, after=start)
    assert "frame_count" in text or "frames, expected" in text
    with Client(live_stack.frontends[1], timeout=300) as client:
        assert client.generate("Hi", temperature=0.0, max_tokens=2).outputs[0].token_ids
    assert live_stack.proc.poll() is None
    for pid in live_stack.pids.values():
        os.kill(pid, 0)  # raises if that child died


def test_sigterm_leaves_no_process_or_socket_file(smollm2_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "256")
    run_dir = stack.run_dir()
    assert any(run_dir.glob("*.sock"))
    with Client(stack.frontends[0], timeout=300) as client:
        assert client.generate("Hi", max_tokens=2).outputs[0].token_ids
    stop_stack(stack)
    for pid in stack.pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not run_dir.exists(), f"left behind: {list(run_dir.iterdir())}"
