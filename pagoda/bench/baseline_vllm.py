"""``--baseline vllm``: vLLM's CPU engine on the same requests, in the same run.

vLLM lives in its own environment (``.venv-vllm``, made by ``scripts/setup_vllm.sh``) and
runs as a subprocess over a workload file (``vllm_runner.py``); pagoda never imports it.
It gets both cores (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), a KV cache of
``VLLM_CPU_KVCACHE_SPACE`` GiB, and tcmalloc and its bundled libiomp5 preloaded, as
vLLM's CPU docs ask. Without the environment the baseline is skipped with a message.

With rounds (``--vllm-rounds``) the subprocess stays up after its first pass and runs
each further pass when told to, over a pair of pipes (``VllmSession.run_round``), so that
its passes can alternate with pagoda's on a machine whose speed drifts.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from pagoda.bench.workload import Workload

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
RUNNER = Path(__file__).with_name("vllm_runner.py")
KV_CACHE_GIB = 4


def vllm_python() -> Path | None:
    python = VENV / "bin" / "python"
    return python if python.is_file() else None


def preloads() -> list[str]:
    """tcmalloc (the system's) and the libiomp5 intel-openmp put in the environment."""
    found = []
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 check=False).stdout
    except OSError:
        listing = ""
    for line in listing.splitlines():
        if "libtcmalloc_minimal.so.4 " in line and "=>" in line:
            found.append(line.split("=>")[1].strip())
            break
    found += [str(p) for p in sorted((VENV / "lib").glob("libiomp5.so"))][:1]
    return found


def _stop(process: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait up to ``timeout`` seconds for the runner to exit, then kill it; reaped."""
    try:
        process.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class VllmSession:
    """A launched vLLM runner: it owns the process and its two pipes (None without
    rounds); ``figures`` are its first pass's once ``start`` returns."""

    def __init__(self, process: subprocess.Popen[bytes], commands: IO[str] | None,
                 replies: IO[str] | None, log: Path, deadline: float) -> None:
        self._process, self._commands, self._replies = process, commands, replies
        self._log, self._deadline = log, deadline
        self.figures: dict[str, Any] = {}

    def start(self, result: Path) -> None:
        """Until the first pass and batch-1 probe are done: the runner reports ready
        (rounds) or exits (without); its figures are then read from ``result``."""
        if self._commands is not None:
            if not self._read_reply().get("ready"):
                raise RuntimeError("vLLM runner did not report ready")
        else:
            _stop(self._process, self._deadline - time.monotonic())
            if self._process.returncode != 0:
                raise self._failure()
        self.figures = json.loads(result.read_text())

    def run_round(self, r: int) -> dict[str, Any]:
        """Round r's pass (the workload's r-th salted copy): its wall time, output tokens
        and output tokens/s."""
        if self._commands is None:
            raise RuntimeError("this vLLM session was started without rounds")
        self._commands.write(f"{r}\n")
        self._commands.flush()
        reply = self._read_reply()
        if reply.get("round") != r:
            raise RuntimeError(f"vLLM runner answered {reply} to round {r}")
        return reply

    def close(self, graceful: bool) -> None:
        """Ends the runner: told to stop and waited for (``graceful``), else killed."""
        if self._commands is not None:
            try:
                if graceful:
                    self._commands.write("stop\n")
                self._commands.close()
            except OSError:  # the runner is gone already: its exit status says why
                pass
        if self._replies is not None:
            self._replies.close()
        _stop(self._process, max(1.0, self._deadline - time.monotonic()) if graceful else 0.0)

    def _failure(self) -> RuntimeError:
        log = self._log
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.exists() else ""
        return RuntimeError(f"vLLM baseline failed (exit {self._process.returncode}): {tail}")

    def _read_reply(self) -> dict[str, Any]:
        """The runner's next line, within the deadline; its death or a wrong line raises."""
        assert self._replies is not None
        left = self._deadline - time.monotonic()
        ready, _, _ = select.select([self._replies], [], [], max(0.0, left))
        line = self._replies.readline() if ready else ""
        if not line:  # EOF: the runner is exiting; no line in time: it is stuck
            _stop(self._process, left if ready else 0.0)
            raise self._failure()
        message: dict[str, Any] = json.loads(line)
        return message


@contextmanager
def vllm_session(model_dir: str, work: Workload, dtype: str, max_model_len: int,
                 bs1_prompt: list[int], bs1_output: int = 128,
                 rounds: list[Workload] | None = None,
                 timeout_s: float = 3600.0) -> Iterator[VllmSession | None]:
    """vLLM's runner on ``work`` (see vllm_runner.py), its first pass and batch-1 probe
    done; with ``rounds`` (same output lengths as ``work``) it stays up for
    ``run_round(1..len(rounds))`` until the block ends. None when vLLM is not installed."""
    python = vllm_python()
    if python is None:
        print(f"pagoda bench: --baseline vllm skipped: {VENV} is missing "
              f"(make it with: bash scripts/setup_vllm.sh)", file=sys.stderr)
        yield None
        return
    rounds = rounds or []
    if any(r.output_lens != work.output_lens for r in rounds):
        raise ValueError("vLLM rounds must keep the workload's output lengths")
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_TARGET_DEVICE": "cpu"}
    if libs := preloads():
        env["LD_PRELOAD"] = ":".join(libs + [env.get("LD_PRELOAD", "")]).rstrip(":")
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-") as tmp:
        workload, result, log = (Path(tmp) / "workload.json", Path(tmp) / "result.json",
                                 Path(tmp) / "runner.log")
        workload.write_text(json.dumps({
            "model": model_dir, "dtype": dtype, "max_model_len": max_model_len,
            "prompts": work.prompts, "output_lens": work.output_lens,
            "bs1_prompt": bs1_prompt, "bs1_output": bs1_output,
            "rounds": [r.prompts for r in rounds]}))
        argv = [str(python), str(RUNNER), str(workload), str(result)]
        commands = replies = None
        child_fds: tuple[int, ...] = ()
        if rounds:
            cmd_read, cmd_write = os.pipe()
            reply_read, reply_write = os.pipe()
            child_fds = (cmd_read, reply_write)
            argv += [str(cmd_read), str(reply_write)]
            commands = os.fdopen(cmd_write, "w", encoding="utf-8")
            replies = os.fdopen(reply_read, "r", encoding="utf-8")
        # its log goes to a file: vLLM writes a lot, and a full pipe would stall it
        with open(log, "wb") as log_file:
            process = subprocess.Popen(argv, env=env, cwd=tmp, stdout=log_file,
                                       stderr=subprocess.STDOUT, pass_fds=child_fds)
        for fd in child_fds:  # the child's ends: closed here, so its exit reads as EOF
            os.close(fd)
        session = VllmSession(process, commands, replies, log, deadline)
        try:
            session.start(result)
            session.figures["ld_preload"] = env.get("LD_PRELOAD")
            yield session
        except BaseException:
            session.close(graceful=False)
            raise
        session.close(graceful=True)


def run_vllm_baseline(model_dir: str, work: Workload, dtype: str, max_model_len: int,
                      bs1_prompt: list[int], bs1_output: int = 128,
                      timeout_s: float = 3600.0) -> dict[str, Any] | None:
    """vLLM's figures on ``work`` (see vllm_runner.py), or None when it is not installed."""
    with vllm_session(model_dir, work, dtype, max_model_len, bs1_prompt, bs1_output,
                      timeout_s=timeout_s) as session:
        return None if session is None else session.figures
