"""Structured output in the scheduler: compiled grammars, a matcher per sequence, and
each step's token bitmasks (vLLM v1's design: the matchers live where the batch is built).

    add_request ──► request(constraint) ──► GrammarEntry: one per distinct constraint, in
                    an LRU cache; compiled on a daemon thread pool, never on the step loop
    schedule()  ──► matcher_ready(seq)? (a request whose grammar compiles waits in the queue,
                    status WAITING_FOR_GRAMMAR) ──► fill_bitmasks(the sequences that sample
                    this step) ──► StepBatch.grammar_seq_ids / grammar_bitmasks
    update()    ──► accept(seq, token); a terminated matcher ends the sequence ("stop")

The grammar of a constraint is ``shared.structured_output.build_grammar`` (the frontend
validated the same one); here it is compiled with xgrammar against the model's
vocabulary: the scheduler loads the tokenizer of ``--model`` for it (lazily, on the pool,
with the first constraint: a stack that never sees one never imports xgrammar or torch).
``TokenizerInfo`` gets the logits' vocabulary size (``WorkerReady.vocab_size``, which may
exceed the tokenizer's: the padding ids are never allowed) and the EOS ids the workers
reported, so "the grammar may end here" allows exactly the scheduler's stop tokens.

A matcher only moves forward: a preempted sequence keeps its output tokens (recompute
re-feeds them to the workers, not to the matcher), so its matcher stays where it was;
each child of ``n > 1`` has its own. A compile that fails, or has not finished
``compile_timeout_s`` after it was asked for, fails every request waiting for it (the
entry stays cached, so the same constraint fails at once; a late success replaces it).
The pool's threads are daemons: a pathological compile cannot hold the process at exit.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.sampling_params import StructuredOutputsParams
from shared.structured_output import GrammarError, build_grammar, clean_message, constraint_key
from shared.tokenizer_loader import load_tokenizer

log = logging.getLogger("pagoda.scheduler")
DEFAULT_COMPILE_THREADS = 2


class GrammarFailed(Exception):
    """A constraint that cannot be used: the message is for the client."""


@dataclass(eq=False)
class GrammarEntry:
    """One distinct constraint: its compile, shared by every request that asks for it."""

    key: tuple[str, str]
    future: Future[Any]  # -> xgrammar.CompiledGrammar
    deadline: float  # monotonic seconds: not compiled by then = failed


@dataclass(eq=False)
class SequenceGrammar:
    """One sequence's grammar state: its entry, then (once compiled) its own matcher."""

    entry: GrammarEntry
    matcher: Any = None  # xgrammar.GrammarMatcher
    terminated: bool = False  # the matcher accepted a complete output (and a stop token)


class StructuredOutputManager:
    """``model_dir``: where the tokenizer is (None: structured output is unavailable);
    ``vocab_size``: the logits' width; ``eos_token_ids``: the workers' stop tokens."""

    def __init__(
        self, model_dir: Path | None, vocab_size: int, eos_token_ids: Sequence[int], *,
        compile_timeout_s: float = 30.0, cache_size: int = 128,
        num_threads: int = DEFAULT_COMPILE_THREADS, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.cache_size = cache_size
        self.clock = clock
        self._cache: OrderedDict[tuple[str, str], GrammarEntry] = OrderedDict()
        self._init_lock = threading.Lock()
        self._compiler: Any = None
        self._init_error: str | None = None
        self._tasks: queue.SimpleQueue[tuple[Future[Any], StructuredOutputsParams] | None] = (
            queue.SimpleQueue())
        self._num_threads = num_threads
        self._threads: list[threading.Thread] = []  # started with the first constraint
        # a byte here when a compile ends, so a loop polling sockets wakes for it too
        self.wakeup_fd, self._wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(self._wakeup_w, False)
        self._rows = np.empty((0, (vocab_size + 31) // 32), dtype="<i4")  # grown on demand

    # -- compiling ---------------------------------------------------------------------
    def request(self, so: StructuredOutputsParams) -> GrammarEntry:
        """The cached entry of this constraint, or a new compile; GrammarFailed when it is
        known to fail."""
        key = constraint_key(so)
        entry = self._cache.get(key)
        if entry is None:
            if not self._threads:
                self._threads = [threading.Thread(target=self._work, name=f"grammar-{i}",
                                                  daemon=True) for i in range(self._num_threads)]
                for t in self._threads:
                    t.start()
            entry = GrammarEntry(key, Future(), self.clock() + self.compile_timeout_s)
            entry.future.add_done_callback(self._wake)
            self._tasks.put((entry.future, so))
            self._cache[key] = entry
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # requests still holding it keep it alive
        else:
            self._cache.move_to_end(key)
        self.compiled(entry)  # raises at once for a known failure
        return entry

    def compiled(self, entry: GrammarEntry) -> Any | None:
        """The compiled grammar, None while it compiles, or GrammarFailed."""
        if entry.future.done():
            error = entry.future.exception()
            if error is not None:
                raise GrammarFailed(str(error) if isinstance(error, (GrammarFailed, GrammarError))
                                    else f"structured output: {clean_message(error)}")
            return entry.future.result()
        if self.clock() > entry.deadline:
            raise GrammarFailed(f"structured output: the grammar did not compile within "
                                f"{self.compile_timeout_s:g}s")
        return None

    def wait(self, entry: GrammarEntry) -> Any:
        """Block until compiled (the offline engine) or GrammarFailed."""
        futures.wait([entry.future], timeout=max(0.0, entry.deadline - self.clock()))
        compiled = self.compiled(entry)
        if compiled is None:  # the deadline passed while waiting
            raise GrammarFailed(f"structured output: the grammar did not compile within "
                                f"{self.compile_timeout_s:g}s")
        return compiled

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, so = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._compiler_or_fail().compile_grammar(build_grammar(so)))
            except BaseException as e:  # noqa: BLE001 -- handed to the requests waiting for it
                future.set_exception(e)

    def _compiler_or_fail(self) -> Any:
        with self._init_lock:
            if self._compiler is None and self._init_error is None:
                try:
                    self._compiler = self._build_compiler()
                except Exception as e:  # noqa: BLE001 -- every constraint fails with this
                    self._init_error = f"structured output is unavailable: {clean_message(e)}"
                    log.warning("%s", self._init_error)
            if self._init_error is not None:
                raise GrammarFailed(self._init_error)
            return self._compiler

    def _build_compiler(self) -> Any:
        if self.model_dir is None or not self.model_dir.is_dir():
            raise RuntimeError(f"the scheduler has no model directory (got {self.model_dir})")
        tokenizer = load_tokenizer(self.model_dir)
        if tokenizer is None:
            raise RuntimeError(f"{self.model_dir} has no tokenizer")
        import xgrammar

        started = time.monotonic()
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
        compiler = xgrammar.GrammarCompiler(info, max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)),
                                            cache_enabled=False)  # the cache is ours
        log.info("structured output ready: xgrammar over %d tokens (%.2fs)", self.vocab_size,
                 time.monotonic() - started)
        return compiler

    def _wake(self, _: Future[Any]) -> None:
        try:
            os.write(self._wakeup_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # full (the loop will look anyway) or closed

    def drain_wakeups(self) -> None:
        try:
            while os.read(self.wakeup_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # -- matching ----------------------------------------------------------------------
    def matcher_ready(self, seq: SequenceGrammar) -> bool:
        """Whether the sequence can be scheduled (its matcher exists); GrammarFailed."""
        if seq.matcher is None:
            compiled = self.compiled(seq.entry)
            if compiled is None:
                return False
            import xgrammar

            seq.matcher = xgrammar.GrammarMatcher(compiled)
        return True

    def fill_bitmasks(self, seqs: list[SequenceGrammar]) -> tuple[list[int], bytes]:
        """The positions in ``seqs`` whose next-token mask excludes something, and their
        masks as little-endian int32 rows (``StepBatch.grammar_bitmasks``)."""
        if len(self._rows) < len(seqs):
            self._rows = np.empty((max(len(seqs), 2 * len(self._rows)), self._rows.shape[1]),
                                  dtype="<i4")
        kept: list[int] = []
        for i, seq in enumerate(seqs):
            # False: every token is allowed, the row is not sent
            if seq.matcher.fill_next_token_bitmask(self._rows, len(kept)):
                kept.append(i)
        return kept, self._rows[: len(kept)].tobytes()

    def accept(self, seq: SequenceGrammar, token: int) -> bool:
        """Advance the matcher; False when the grammar refuses the token."""
        if not seq.matcher.accept_token(token):
            return False
        seq.terminated = seq.matcher.is_terminated()
        return True

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for fd in (self.wakeup_fd, self._wakeup_w):
            try:
                os.close(fd)
            except OSError:
                pass
